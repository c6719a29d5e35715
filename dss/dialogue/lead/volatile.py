"""Which differences between two system prompts are volatile values: the date and time a
frontend templates into its system prompt on every request, and whatever an operator's
patterns name (a user's name or location, a memory block).

A prompt is split into its skeleton (the text around the recognised values) and its values.
Two prompts whose skeletons are equal differ only in volatile values; the values that differ are
the change a lead update states (`dss.dialogue.lead.update`). Pure functions over text.

The built-in recogniser knows the formats the frontends in docs/frontends.md write: ISO dates and
date-times (Open WebUI's `{{CURRENT_DATE}}`, `{{CURRENT_DATETIME}}`, LibreChat's
`{{iso_datetime}}`), clock times with or without seconds and AM/PM (`{{CURRENT_TIME}}`),
numeric dates (`12/5/2026`, `05.12.2026`: AnythingLLM's `{datetime}` in an en-US locale), dates
with month names (`December 5, 2026`, `5 December 2026`, `Dec 5 2026`) and weekday names.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from dss.errors import InvalidInput

_MONTHS = (
    "January|February|March|April|May|June|July|August|September|October|November|December"
    "|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
)
_WEEKDAYS = "Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday"
_TIME = r"\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:\s?[AaPp]\.?[Mm]\.?)?"
_ZONE = r"(?:\s?(?:Z|UTC|GMT|[+-]\d{2}:?\d{2}))?"

# Longest forms first: a date-time is one value, not a date and a time.
BUILTIN: Final[tuple[str, ...]] = (
    rf"\d{{4}}-\d{{2}}-\d{{2}}(?:[T ]{_TIME}{_ZONE})?",  # ISO date, date-time
    rf"\d{{1,2}}/\d{{1,2}}/\d{{2,4}}(?:,?\s{_TIME})?",  # 12/5/2026, 1:05:33 AM
    rf"\d{{1,2}}\.\d{{1,2}}\.\d{{4}}(?:,?\s{_TIME})?",  # 05.12.2026
    rf"(?:{_MONTHS})\.?\s\d{{1,2}}(?:st|nd|rd|th)?,?\s\d{{4}}",  # December 5, 2026
    rf"\d{{1,2}}(?:st|nd|rd|th)?\s(?:{_MONTHS})\.?,?\s\d{{4}}",  # 5 December 2026
    rf"{_TIME}{_ZONE}",
    rf"\b(?:{_WEEKDAYS})\b",
)
MAX_PATTERNS = 16
MAX_PATTERN_CHARS = 512


@dataclass(frozen=True, slots=True)
class Value:
    """One recognised value: where it stands in its prompt and its text."""

    start: int
    end: int
    text: str


@dataclass(frozen=True, slots=True)
class Changed:
    """A volatile value that differs between the stored prompt and the new one."""

    old: str
    new: str
    at: int  # where the new value starts in the new prompt


class Recogniser:
    """The built-in patterns and an operator's own, as one alternation (the operator's first:
    a memory block or a name is theirs to bound)."""

    def __init__(self, patterns: Sequence[str] = ()) -> None:
        self.patterns = tuple(check_patterns(patterns))
        self._re = re.compile("|".join(f"(?:{_scoped(p)})" for p in (*self.patterns, *BUILTIN)))

    def values(self, text: str) -> list[Value]:
        return [Value(m.start(), m.end(), m.group()) for m in self._re.finditer(text) if m.end() > m.start()]

    def skeleton(self, text: str) -> tuple[str, list[Value]]:
        """The text with each value cut out (a NUL marks where it stood), and the values."""
        values = self.values(text)
        parts, pos = [], 0
        for v in values:
            parts += [text[pos : v.start], "\0"]
            pos = v.end
        parts.append(text[pos:])
        return "".join(parts), values

    def changed(self, old: str, new: str) -> list[Changed] | None:
        """The values that differ when `old` and `new` differ only in volatile values; None when
        anything else differs (their skeletons are not equal)."""
        old_skel, old_values = self.skeleton(old)
        new_skel, new_values = self.skeleton(new)
        if old_skel != new_skel:
            return None
        return [
            Changed(o.text, n.text, n.start)
            for o, n in zip(old_values, new_values, strict=True)
            if o.text != n.text
        ]


_GLOBAL_FLAGS = re.compile(r"\(\?([imsx]+)\)(.*)", re.DOTALL)


def _scoped(pattern: str) -> str:
    """A pattern's leading global flags (`(?s)...`) as a scoped group (`(?s:...)`): global flags
    are refused inside the alternation that joins the patterns."""
    m = _GLOBAL_FLAGS.fullmatch(pattern)
    return f"(?{m.group(1)}:{m.group(2)})" if m else pattern


def check_patterns(patterns: Sequence[str]) -> list[str]:
    """Operator patterns as given, each a valid regular expression that cannot match the empty
    string everywhere; `InvalidInput` naming the first that is not."""
    if len(patterns) > MAX_PATTERNS:
        raise InvalidInput(f"at most {MAX_PATTERNS} volatile patterns; got {len(patterns)}")
    out = []
    for i, p in enumerate(patterns):
        if not isinstance(p, str) or not p or len(p) > MAX_PATTERN_CHARS:
            raise InvalidInput(
                f"volatile_patterns[{i}]: a non-empty regular expression of at most "
                f"{MAX_PATTERN_CHARS} characters"
            )
        try:
            compiled = re.compile(p)
            re.compile(f"(?:{_scoped(p)})|x")  # it must also stand inside the joined alternation
        except re.error as exc:
            raise InvalidInput(f"volatile_patterns[{i}]: not a regular expression: {exc}") from None
        if compiled.fullmatch(""):
            raise InvalidInput(f"volatile_patterns[{i}]: {p!r} matches the empty text")
        out.append(p)
    return out
