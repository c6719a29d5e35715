"""Build a turn's prompt: vLLM validates the request once, the prompt continues the version's
stored ids (`dss.dialogue.continuation`) or renders the whole dialogue, and `max_tokens` is fixed
against the context; then the tenant and its prefix-cache salt.

Pages are warmed once, by the connector: it promotes the pages it loads when vLLM schedules the
request (`engine_patch.connector`). The API starts no second, background warm-up of the version
here (the retention service's `warm_version` did, and is gone): that re-read the version from the
database in a worker thread and queued promotions of the same pages the connector's lookup
promotes a moment later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from api.llm.chat_engine import ChatEngine
from api.state import AppState
from api.turn.lead import PromptPlan, plan_prompt
from api.turn.truncate import shortened
from api.turn.types import Prepared, Turn


async def prepare(state: AppState, engine: ChatEngine, turn: Turn) -> Prepared:
    """vLLM's validation of the request (once), the prompt and its length: with the limits, the
    400s a turn can get before a stream starts. (What vLLM checks against the model when the
    request reaches the engine, such as `top_logprobs` above its maximum, fails in `generate`: in
    a stream, as an error event after the 200, as in vLLM's own server.)"""
    lim = state.settings.limits
    # Validated first (a malformed tool must not reach the template); max_tokens is set below,
    # once the prompt's length is known, from this same validated request.
    validated = engine.validate(turn.messages, turn.fields)
    placement = state.settings.lead.placement
    plan = await asyncio.to_thread(prompt_for, engine, turn, validated.tools, placement)
    answer_room = turn.params.requested_max_tokens or lim.default_max_tokens
    if turn.truncate and len(plan.ids) + answer_room > engine.max_model_len:
        room = engine.max_model_len - answer_room
        cut = await asyncio.to_thread(shortened, engine, turn.messages, validated.tools, room, plan.lead)
        plan = cut or plan  # none fits: the length check below says so
    prompt_ids = plan.ids
    max_tokens = engine.check_length(
        len(prompt_ids), turn.params.requested_max_tokens, lim.default_max_tokens
    )
    sampling = engine.sampling_for(validated, max_tokens)
    store = state.store
    if turn.epoch is not None:  # the turn's own tenant: an erasure since retired it
        tenant = store.identity.tenant_at(turn.user, turn.epoch)
        salt = store.identity.cache_salt(turn.user, turn.epoch)
    else:
        tenant = store.identity.tenant_for(turn.user)
        salt = await asyncio.to_thread(store.identity.cache_salt, turn.user)
    return Prepared(
        prompt_ids, sampling, tenant, salt, seen=plan.seen, lead=plan.lead, truncated=plan.truncated
    )


def prompt_for(
    engine: ChatEngine, turn: Turn, tools: Sequence[Mapping[str, Any]] = (), placement: str = "note"
) -> PromptPlan:
    """The turn's prompt. A turn that extends a version continues from the version's stored
    token ids (they are what the KV cache holds), as the model saw them, with a lead update when
    its lead changed (`api.turn.lead`); its messages stay the record for listings and clients.
    Other turns render the whole dialogue."""
    return plan_prompt(engine, turn.target, turn.messages, tools, placement)
