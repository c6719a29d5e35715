"""Lead updates in a turn (`dss.dialogue.lead`): the policy a request gets, the prompt of a turn
served as one, and what its response reports.

The policy: the server's setting (`DSS_LEAD__UPDATES`, for development mode and user keys), a
frontend's own for its keys, a request's `lead_updates` (or `X-DSS-Lead-Updates`) over both;
off for a frontend whose quality gate tripped. The prompt: the stored ids of the version, as the
model saw them (`ModelView`), then the update and the new messages, placed where the template
takes them (a late system message or a note in the new user message, the configured placement
first) and checked to hold the update's text; a template that takes neither renders the whole
dialogue, and the turn says so (`template_cannot_continue`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from api.auth import Caller
from api.llm.chat_engine import ChatEngine
from api.settings import LeadSettings
from dss.dialogue.continuation import continuable, extended_messages
from dss.dialogue.lead.gate import QualityGate
from dss.dialogue.lead.policy import NO_STORED_IDS, SERVER, TEMPLATE, LeadDrift, LeadPolicy, check_mode
from dss.dialogue.lead.update import noted, system_update, update_text
from dss.dialogue.lead.view import ModelView
from dss.dialogue.turns import TurnTarget
from dss.errors import InvalidInput

LEAD_HEADER = "X-DSS-Lead-Updates"


@dataclass(frozen=True, slots=True)
class LeadReport:
    """What a turn whose lead changed reports (the `dss.lead_update` block, the metrics)."""

    served: bool
    reason: str | None  # why not served
    kind: str | None  # volatile | prompt
    changed: list[dict[str, str]] = field(default_factory=list)  # {"old", "new"} per value
    placement: str | None = None  # system | note
    update: str | None = None  # the text the model was told
    update_tokens: int = 0
    reused_tokens: int = 0  # the stored ids (the history as computed) the prompt starts with
    frontend: str = SERVER

    def not_served(self, reason: str) -> LeadReport:
        return LeadReport(False, reason, self.kind, self.changed, frontend=self.frontend)


@dataclass(frozen=True, slots=True)
class PromptPlan:
    ids: list[int]
    seen: dict[str, Any] | None  # what the model saw of the committed messages (None: them)
    lead: LeadReport | None
    truncated: int = 0  # messages cut from the front of the history (`api.turn.truncate`)


def policy_for(
    settings: LeadSettings, gate: QualityGate, caller: Caller, requested: str | None
) -> LeadPolicy:
    mode: str = settings.updates
    patterns = tuple(settings.volatile_patterns)
    name = SERVER
    fe = caller.frontend
    if fe is not None:
        name = fe.name
        mode = fe.lead_updates or mode
        patterns = (*patterns, *fe.volatile_patterns)
    if requested is not None:
        mode = requested
    gated = gate.tripped(name)
    return LeadPolicy(check_mode(mode), patterns, name, gated=gated)


def requested_mode(body_value: str | None, headers: Mapping[str, str]) -> str | None:
    """The request's own choice: the body's `lead_updates`, else the header (checked)."""
    if body_value is not None:
        return body_value
    value = headers.get(LEAD_HEADER)
    if value is None or not value.strip():
        return None
    return check_mode(value.strip().lower())


def plan_prompt(
    engine: ChatEngine,
    target: TurnTarget | None,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    placement: str,
) -> PromptPlan:
    """The turn's prompt: continued from the version's stored ids where it can be (with the
    lead's update when its lead changed and may be served so), else the whole dialogue."""
    base = target.base if target is not None else None
    drift = target.lead if target is not None else None
    serve = drift is not None and drift.served
    report = _report(drift)
    n = extended_messages(base, messages, engine.fingerprint, lead_updated=serve)
    if base is not None and n is not None:
        view = ModelView.of(base.seen)
        base_seen = view.seen(base.messages)
        stored = base.tokens.tolist()
        new = [dict(m) for m in messages[n:]]
        if serve and drift is not None and drift.change is not None:
            if 0 not in dict(view.replaced):  # the ids start with the lead the history saw
                view = view.replacing(0, base.messages[0])
            text = update_text(drift.change)
            for where in (placement, *(p for p in ("system", "note") if p != placement)):
                placed = _placed(engine, stored, base_seen, new, n, text, view, tools, where)
                if placed is not None:
                    ids, seen_view = placed
                    done = _served(report, where, text, len(engine.encode(text)), len(stored))
                    return PromptPlan(ids, seen_view.record(), done, _dropped(seen_view))
            report = report.not_served(TEMPLATE) if report is not None else None
        else:
            continued = _continue(engine, stored, base_seen, new, tools)
            if continued is not None:
                return PromptPlan(continued, view.record(), report, _dropped(view))
    elif serve and report is not None:
        report = report.not_served(TEMPLATE if continuable(base, engine.fingerprint) else NO_STORED_IDS)
    return PromptPlan(engine.render(messages, tools=tools), None, report)


def _placed(
    engine: ChatEngine,
    stored: list[int],
    base_seen: list[dict[str, Any]],
    new: list[dict[str, Any]],
    n: int,
    text: str,
    view: ModelView,
    tools: Sequence[Mapping[str, Any]],
    where: str,
) -> tuple[list[int], ModelView] | None:
    """The prompt with the update placed `where`, and the view the version records; None when
    the template refuses it there or drops it (its text must be in what follows the stored ids)."""
    if where == "system":
        update = system_update(text)
        seen_new, seen_view = [update, *new], view.inserting(n, update)
    else:
        users = [i for i, m in enumerate(new) if m.get("role") == "user"]
        note = noted(new[users[-1]], text) if users else None
        if note is None:
            return None
        k = users[-1]
        seen_new = [*new[:k], note, *new[k + 1 :]]
        seen_view = view.replacing(n + k, note)
    ids = _continue(engine, stored, base_seen, seen_new, tools)
    if ids is None or text not in engine.decode(ids[len(stored) :]):
        return None
    return ids, seen_view


def _dropped(view: ModelView) -> int:
    return view.dropped[1] - view.dropped[0] if view.dropped is not None else 0


def _continue(
    engine: ChatEngine,
    stored: list[int],
    base_seen: list[dict[str, Any]],
    new: list[dict[str, Any]],
    tools: Sequence[Mapping[str, Any]],
) -> list[int] | None:
    try:
        return engine.continue_from(stored, base_seen, new, tools)
    except InvalidInput:  # the template refused the dialogue so: render it whole
        return None


def _report(drift: LeadDrift | None) -> LeadReport | None:
    if drift is None:
        return None
    change = drift.change
    return LeadReport(
        served=False,
        reason=drift.reason,
        kind=change.kind if change is not None else None,
        changed=[{"old": v.old, "new": v.new} for v in change.values] if change is not None else [],
        frontend=drift.frontend,
    )


def _served(report: LeadReport | None, where: str, text: str, n_tokens: int, reused: int) -> LeadReport:
    assert report is not None
    return LeadReport(True, None, report.kind, report.changed, where, text, n_tokens, reused, report.frontend)
