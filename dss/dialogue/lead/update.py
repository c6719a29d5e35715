"""The update a lead-update turn states after the stored history: its text, and the message it
takes in the dialogue the model sees.

What it says: for a volatile change, each line of the new lead that holds a changed value, as it
reads now (the value with its own label: "Current date and time: 2026-12-05 01:12:33"); for any
other change (mode `any`), the whole new lead. Where it goes, per chat template (chosen by
`api.llm.chat_engine`, which renders the template): `system`, a system message right before the
new user message, where the template accepts one there; otherwise `note`, the same text before
the new user message's own, in that message. The wording and placement were chosen by
measurement (`bench/volatile.py`; the figures are in docs/frontends.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

from dss.dialogue.lead.policy import LeadChange

Placement = Literal["system", "note"]
PLACEMENTS: Final[tuple[str, ...]] = ("system", "note")
MAX_LINE_CHARS = 400


def update_text(change: LeadChange) -> str:
    """What the model is told: the lines of the new lead that hold a changed value (the whole
    new lead for a change beyond volatile values)."""
    if change.kind == "prompt" or not change.values:
        return change.new
    lines: list[str] = []
    for value in change.values:
        line = _line_at(change.new, value.at)
        if line not in lines:
            lines.append(line)
    return "\n".join(lines)


def _line_at(text: str, at: int) -> str:
    start = text.rfind("\n", 0, at) + 1
    end = text.find("\n", at)
    line = text[start : len(text) if end < 0 else end].strip()
    if len(line) <= MAX_LINE_CHARS:
        return line
    # A long paragraph: the sentence around the value.
    s = max(text.rfind(". ", start, at) + 2, start, at - MAX_LINE_CHARS // 2)
    e = text.find(". ", at, min(len(text), at + MAX_LINE_CHARS // 2))
    return text[s : (e + 1 if e >= 0 else min(len(text), at + MAX_LINE_CHARS // 2))].strip()


def system_update(text: str) -> dict[str, Any]:
    """The update as a late system message."""
    return {"role": "system", "content": text}


def noted(user_message: Mapping[str, Any], text: str) -> dict[str, Any] | None:
    """The new user message with the update before its own text; None when its content is not
    text (the caller then places the update as a system message or not at all)."""
    content = user_message.get("content")
    note = f"({text})\n\n"
    if isinstance(content, str):
        return {**user_message, "content": note + content}
    if isinstance(content, list) and content:
        return {**user_message, "content": [{"type": "text", "text": note}, *content]}
    return None
