"""`truncation: "auto"`: a stateful, Responses or Conversations turn whose dialogue outgrew the
context is shortened in large steps at message boundaries (`dss.dialogue.truncation`), so that
the turns after it extend the same shortened prefix from cache. The version keeps every message;
what the model saw is recorded with it (`ModelView.dropped`). A turn whose lead changed is then
rendered whole with the new lead (`history_truncated`): a cut recomputes the prompt anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from api.llm.chat_engine import ChatEngine
from api.turn.lead import LeadReport, PromptPlan
from dss.dialogue.lead.policy import has_lead, lead_text
from dss.dialogue.lead.view import ModelView
from dss.dialogue.truncation import cut_points

TRUNCATED = "history_truncated"
# Per message, what the template writes around its text (role markers, separators): an
# estimate only; every cut is checked by rendering it.
TEMPLATE_OVERHEAD_TOKENS = 8
MAX_TRIES = 8


def shortened(
    engine: ChatEngine,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]],
    room: int,
    lead: LeadReport | None = None,
) -> PromptPlan | None:
    """The prompt of `messages` cut to fit `room` tokens (the context less the answer's), or None
    when even the newest user turn does not fit."""
    roles = [str(m.get("role")) for m in messages]
    sizes = [len(engine.encode(lead_text(m) or "")) + TEMPLATE_OVERHEAD_TOKENS for m in messages]
    first = 1 if has_lead(messages) else 0
    for cut in cut_points(roles, sizes, bool(first), room)[:MAX_TRIES]:
        view = ModelView(dropped=(first, cut))
        ids = engine.render(view.seen(messages), tools=tools)
        if len(ids) <= room:
            report = lead.not_served(TRUNCATED) if lead is not None else None
            return PromptPlan(ids, view.record(), report, truncated=cut - first)
    return None
