"""The OpenAI Conversations API on DSS sessions: create, retrieve, update, delete a conversation;
list, add, retrieve and delete its items. `POST /v1/responses` with `conversation` answers in
one (`api.routes.responses`).

A conversation is a session and its items are the messages of its `main` head
(`dss.dialogue.conversations`): every change is a new version, and the conversation is durable,
erased with its user, and 404 to every other user exactly like a missing one.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request

from api.deps import PrincipalDep, StateDep, request_route_key
from api.http_errors import error_responses
from api.shapes.conversations import (
    ConversationCreate,
    ConversationUpdate,
    ItemsCreate,
    conversation_body,
    deleted_body,
    item_list,
)
from api.shapes.openai_responses import stored_items
from api.state import AppState
from api.turn.request import check_dialogue
from dss.dialogue.conversations import item_message
from dss.types import SessionId, UserId

router = APIRouter(tags=["conversations"])


def _admitted(state: AppState, user: UserId) -> int:
    """The user's erasure epoch as a write is admitted, before it reads or checks anything: its
    store writes are refused (`UserErased`, 409) if the user is erased before they commit."""
    return state.store.identity.epoch_of(user)


# OpenAI's `include`: optional data (tool outputs, images, log-probabilities) that no stored item
# holds, so it is accepted and changes nothing.
IncludeQuery = Annotated[list[str] | None, Query(description="accepted; no stored item holds optional data")]


def _checked_items(state: AppState, body_items: list[Any]) -> list[dict[str, Any]]:
    """The request's items with their ids, checked against the limits on a dialogue's messages
    (every later turn renders them): valid text, message size, JSON bounds."""
    items = stored_items(body_items)
    check_dialogue(state.settings.limits, [item_message(i) for i in items], "items")
    return items


@router.post("/v1/conversations", responses=error_responses(400, 401, 409, 429))
def create_conversation(
    body: ConversationCreate, request: Request, state: StateDep, principal: PrincipalDep
) -> dict[str, Any]:
    """A new conversation (a session with a `conv_` id), seeded with `items` if given. Its id
    begins with the route key the router hashed this request on (`X-DSS-Route`), so that every
    later request naming the conversation reaches this server (`dss.dialogue.route_keys`)."""
    epoch = _admitted(state, principal.user)
    items = _checked_items(state, list(body.items or []))
    conv = state.store.conversations.create(
        principal.user,
        items,
        body.metadata,
        state.settings.limits.max_messages,
        epoch=epoch,
        route_key=request_route_key(request),
    )
    return conversation_body(conv)


@router.get("/v1/conversations/{conversation_id}", responses=error_responses(401, 404))
def get_conversation(conversation_id: str, state: StateDep, principal: PrincipalDep) -> dict[str, Any]:
    return conversation_body(state.store.conversations.get(principal.user, SessionId(conversation_id)))


@router.post("/v1/conversations/{conversation_id}", responses=error_responses(400, 401, 404, 409))
def update_conversation(
    conversation_id: str, body: ConversationUpdate, state: StateDep, principal: PrincipalDep
) -> dict[str, Any]:
    """Replace the conversation's metadata."""
    epoch = _admitted(state, principal.user)
    conv = state.store.conversations.set_metadata(
        principal.user, SessionId(conversation_id), body.metadata, epoch=epoch
    )
    return conversation_body(conv)


@router.delete("/v1/conversations/{conversation_id}", responses=error_responses(401, 404, 409))
def delete_conversation(conversation_id: str, state: StateDep, principal: PrincipalDep) -> dict[str, Any]:
    """Delete the conversation: its session, every version and the responses made in it."""
    epoch = _admitted(state, principal.user)
    cid = SessionId(conversation_id)
    state.store.conversations.get(principal.user, cid)  # another user's: 404 as a conversation
    state.store.sessions.delete(principal.user, cid, epoch=epoch)
    return deleted_body(cid)


@router.get("/v1/conversations/{conversation_id}/items", responses=error_responses(400, 401, 404))
def list_items(
    conversation_id: str,
    state: StateDep,
    principal: PrincipalDep,
    limit: int = Query(default=20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = Query(default=None, max_length=128),
    include: IncludeQuery = None,
) -> dict[str, Any]:
    """The items, OpenAI's order (newest first by default), `limit` after the item `after`.
    `include` names optional data (tool outputs, images, log-probabilities) that no stored item
    holds, so it changes nothing."""
    page = state.store.conversations.page(principal.user, SessionId(conversation_id), limit, after, order)
    return item_list(page.items, page.has_more)


@router.post("/v1/conversations/{conversation_id}/items", responses=error_responses(400, 401, 404, 409, 429))
def add_items(
    conversation_id: str,
    body: ItemsCreate,
    state: StateDep,
    principal: PrincipalDep,
    include: IncludeQuery = None,
) -> dict[str, Any]:
    """Add items at the end: a new version of the conversation. 409 when it changed meanwhile
    (or its user was erased since the request arrived: `user_erased`)."""
    epoch = _admitted(state, principal.user)
    items = _checked_items(state, list(body.items))
    added = state.store.conversations.append(
        principal.user, SessionId(conversation_id), items, state.settings.limits.max_messages, epoch=epoch
    )
    return item_list(added, False)


@router.get("/v1/conversations/{conversation_id}/items/{item_id}", responses=error_responses(401, 404))
def get_item(
    conversation_id: str,
    item_id: str,
    state: StateDep,
    principal: PrincipalDep,
    include: IncludeQuery = None,
) -> dict[str, Any]:
    return state.store.conversations.item(principal.user, SessionId(conversation_id), item_id)


@router.delete(
    "/v1/conversations/{conversation_id}/items/{item_id}", responses=error_responses(401, 404, 409, 429)
)
def delete_item(
    conversation_id: str, item_id: str, state: StateDep, principal: PrincipalDep
) -> dict[str, Any]:
    """A new version of the conversation without the item (earlier versions keep it); answers
    the conversation, as OpenAI's API does."""
    epoch = _admitted(state, principal.user)
    conv = state.store.conversations.delete_item(
        principal.user, SessionId(conversation_id), item_id, epoch=epoch
    )
    return conversation_body(conv)
