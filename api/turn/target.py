"""Resolve a turn's target: the session, the version it extends and its branch, and the whole
dialogue its prompt renders. One resolver per way of asking, each reading the store in a worker
thread under the epoch the turn was admitted with (`dss.dialogue.turn_commits` holds the rules).

Each resolver checks the limits table (`api.turn.limits`) once, on the whole dialogue, as soon as
it knows it and before anything is written: a chat turn's request is its whole dialogue, and
resolving it may open its session, so it is checked first; a stateful or Responses turn's
dialogue is the stored one plus the new input, known only after reading (which writes nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from api.shapes.schemas import GenerationParams
from api.state import AppState
from api.turn.limits import check_limits
from api.turn.types import Turn
from dss.dialogue.lead.policy import LeadPolicy
from dss.dialogue.turn_commits import chat_target, message_target, response_target
from dss.types import SessionId, UserId


async def chat_turn(
    state: AppState,
    user: UserId,
    messages: list[dict[str, Any]],
    params: GenerationParams,
    fields: Mapping[str, Any],
    session_id: SessionId | None,
    state_version: int | None,
    lead_policy: LeadPolicy,
    epoch: int,
) -> Turn:
    """A Chat Completions turn: the client sends the whole dialogue; with a session, the turn
    attaches where that dialogue's history was stored (or forks where it was edited; or, when
    only its lead changed, extends that version: `api.turn.lead`)."""
    check_limits(state.settings.limits, params, messages, fields)
    target = None
    if session_id is not None:
        target = await asyncio.to_thread(
            chat_target,
            state.store.versions,
            user,
            session_id,
            messages,
            state_version,
            epoch,
            lead_policy,
        )
    return Turn(user, messages, params, target, fields, epoch=epoch)


async def message_turn(
    state: AppState,
    user: UserId,
    session_id: SessionId,
    branch: str | None,
    version: int | None,
    text: str,
    params: GenerationParams,
    fields: Mapping[str, Any],
    truncate: bool,
    epoch: int,
) -> Turn:
    """A stateful turn: the stored dialogue of the branch (or version), then the new message."""
    target, base = await asyncio.to_thread(
        message_target, state.store.versions, user, session_id, branch, version
    )
    messages = [*base, {"role": "user", "content": text}]
    check_limits(state.settings.limits, params, messages, fields)
    return Turn(user, messages, params, target, fields, epoch=epoch, truncate=truncate)


async def response_turn(
    state: AppState,
    user: UserId,
    previous_response_id: str | None,
    instructions: str | None,
    new: list[dict[str, Any]],
    store: bool,
    params: GenerationParams,
    fields: Mapping[str, Any],
    lead_policy: LeadPolicy,
    truncate: bool,
    epoch: int,
) -> Turn:
    """A Responses turn: the chain of `previous_response_id` (a session of its own), the
    instructions, then the new input items. `store: false` keeps nothing, not even KV: the
    connector neither loads nor saves it."""
    planned = await asyncio.to_thread(
        response_target,
        state.store.versions,
        state.store.responses,
        user,
        previous_response_id,
        instructions,
        new,
        store,
        lead_policy,
    )
    check_limits(state.settings.limits, params, planned.messages, fields)
    return Turn(
        user, planned.messages, params, planned.target, fields, persist=store, epoch=epoch, truncate=truncate
    )


async def conversation_turn(
    state: AppState,
    user: UserId,
    conversation_id: SessionId,
    instructions: str | None,
    new: list[dict[str, Any]],
    answer_item_id: str,
    params: GenerationParams,
    fields: Mapping[str, Any],
    truncate: bool,
    lead_policy: LeadPolicy,
    epoch: int,
) -> Turn:
    """A Responses turn in a conversation (`dss.dialogue.conversations`): the instructions, the
    conversation's items, then the new input items (each message keeps its item id, and the
    answer is stored under `answer_item_id`); committed on the conversation's `main`."""
    planned = await asyncio.to_thread(
        state.store.conversations.turn, user, conversation_id, instructions, new, lead_policy
    )
    check_limits(state.settings.limits, params, planned.messages, fields)
    return Turn(
        user,
        planned.messages,
        params,
        planned.target,
        fields,
        epoch=epoch,
        answer_item_id=answer_item_id,
        truncate=truncate,
    )
