"""Whether a turn whose lead (its system message, or a response's instructions) differs from the
stored version's may still extend that version, and what changed.

Modes: `off` (the turn renders its whole dialogue, as before), `volatile` (only a lead whose
differences are all volatile values: `dss.dialogue.lead.volatile`), `any` (any change of a
text lead; the update restates the whole new prompt). Why `any` is its own opt-in: a volatile
value is a fact the model looks up when asked, and stating its new value at the end is what an
exact prompt would make the model use; a persona or instruction edit changes how every stored
answer was meant to be written, and the quality gate's sample is the only evidence that a model
follows such an edit from the end of the dialogue as it would from the start.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from dss.dialogue.lead.volatile import Changed, Recogniser
from dss.errors import InvalidInput

Mode = Literal["off", "volatile", "any"]
MODES: Final[tuple[str, ...]] = ("off", "volatile", "any")
LEAD_ROLES: Final = frozenset({"system", "developer"})
SERVER: Final = "(server)"  # whose figures development mode's and user keys' turns count in

# Why a turn whose lead changed was not served from the stored version (`LeadDrift.reason`).
OFF = "off"  # lead updates are off for this key (or this request)
NOT_VOLATILE = "changed_beyond_volatile_values"
NOT_TEXT = "lead_not_plain_text"
GATED = "quality_gate_tripped"
NO_STORED_IDS = "no_stored_token_ids"
TEMPLATE = "template_cannot_continue"


@dataclass(frozen=True, slots=True)
class LeadPolicy:
    mode: Mode = "off"
    patterns: tuple[str, ...] = ()
    frontend: str = SERVER  # whose quality figures the turn counts in
    gated: bool = False  # the quality gate stopped lead updates for that frontend

    def __post_init__(self) -> None:
        check_mode(self.mode)

    @property
    def recogniser(self) -> Recogniser:
        return Recogniser(self.patterns)


@dataclass(frozen=True, slots=True)
class LeadChange:
    """The lead of the stored version and the new one, and what differs: the volatile values
    (`kind` volatile), or the whole prompt (`kind` prompt)."""

    old: str
    new: str
    kind: Literal["volatile", "prompt"]
    values: tuple[Changed, ...] = field(default=())


@dataclass(frozen=True, slots=True)
class LeadDrift:
    """A turn whose dialogue equals a stored version's but for the lead: served as a lead update
    on that version (`reason` None), or not, and why."""

    change: LeadChange | None
    reason: str | None = None
    frontend: str = SERVER  # whose quality figures it counts in

    @property
    def served(self) -> bool:
        return self.reason is None


def check_mode(mode: object) -> Mode:
    if mode not in MODES:
        raise InvalidInput(f"lead_updates must be one of {', '.join(MODES)}; got {mode!r}")
    return mode  # type: ignore[return-value]


def lead_text(message: Mapping[str, Any]) -> str | None:
    """A lead message's text: its string content, or its text parts joined; None for anything
    else (an image in a system prompt is not a value to restate)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") in ("text", "input_text") and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(str(p["text"]) for p in content)
    return None


def has_lead(messages: Sequence[Mapping[str, Any]]) -> bool:
    return bool(messages) and messages[0].get("role") in LEAD_ROLES


def same_but_lead(stored: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Both are leads of one role, and only their content differs."""
    keys = (set(stored) | set(new)) - {"content"}
    return stored.get("role") in LEAD_ROLES and all(stored.get(k) == new.get(k) for k in keys)


def classify(policy: LeadPolicy, stored: Mapping[str, Any], new: Mapping[str, Any]) -> LeadDrift:
    """What serving a turn whose lead went from `stored` to `new` (both leads: `same_but_lead`)
    from the stored version amounts to under `policy`."""
    old_text, new_text = lead_text(stored), lead_text(new)
    if old_text is None or new_text is None:
        return LeadDrift(None, NOT_TEXT, policy.frontend)
    values = policy.recogniser.changed(old_text, new_text)
    if values is not None:
        change = LeadChange(old_text, new_text, "volatile", tuple(values))
    else:
        change = LeadChange(old_text, new_text, "prompt")
    if policy.mode == "off":
        return LeadDrift(change, OFF, policy.frontend)
    if change.kind == "prompt" and policy.mode != "any":
        return LeadDrift(change, NOT_VOLATILE, policy.frontend)
    if policy.gated:
        return LeadDrift(change, GATED, policy.frontend)
    return LeadDrift(change, None, policy.frontend)
