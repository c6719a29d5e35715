"""The OpenAI Responses API: create, retrieve, delete, list a response's input items.

Each stored response is a version (`api.shapes.openai_responses`, `dss.dialogue.response_store`): durable,
branchable (`previous_response_id` naming an older response forks), erased with its user. A
response with `conversation` is a version on that conversation's `main` (`api.routes.conversations`).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query, Request

from api.deps import (
    CallerDep,
    EngineDep,
    PrincipalDep,
    SessionHeadersDep,
    StateDep,
    acting_principal,
    request_route_key,
)
from api.http_errors import SessionHeaderOnResponses, error_responses
from api.shapes.openai_responses import (
    ResponseCreate,
    ResponsePlan,
    ResponseShape,
    item_messages,
    response_body,
    stored_items,
)
from api.turn.lead import policy_for, requested_mode
from api.turn.request import ConversationTurn, ResponseTurn, TurnParams, TurnRequest
from api.turn.respond import serve_turn
from dss.dialogue.conversations import item_message
from dss.dialogue.response_store import new_response_id
from dss.dialogue.route_keys import route_key_for
from dss.errors import ModelNotFound

router = APIRouter(tags=["responses"])


@router.post(
    "/v1/responses",
    responses={
        **error_responses(400, 401, 404, 409, 413, 503),
        200: {"content": {"text/event-stream": {}}, "description": "A response, or its events with stream"},
    },
)
async def create_response(
    body: ResponseCreate,
    request: Request,
    state: StateDep,
    caller: CallerDep,
    engine: EngineDep,
    session_headers: SessionHeadersDep,
) -> Any:
    """Answer `input`, continuing `previous_response_id` or `conversation` if given (not both);
    stored as a version unless `store` is false (a response in a conversation always is, and its
    input and output items join the conversation)."""
    who = acting_principal(request, caller, body.user, body.safety_identifier)
    if session_headers.named:
        # A response's dialogue is its `previous_response_id` chain or its `conversation`; a
        # session header here would otherwise be dropped without a word.
        raise SessionHeaderOnResponses(session_headers.named[0][0])
    if body.model and body.model not in engine.model_names:
        raise ModelNotFound(f"the model {body.model!r} does not exist on this server")
    body.check_fields()
    items = body.items()
    # The new response id carries the route key of the chain it continues, of its conversation,
    # else the one the router hashed this request on (`dss.dialogue.route_keys`).
    route = route_key_for(body.previous_response_id, body.conversation_id, request_route_key(request))
    plan = ResponsePlan(body, stored_items(items), id=new_response_id(route))
    plan.check_json(state.settings.limits.json_limits)
    params = TurnParams(max_tokens=body.max_output_tokens)
    fields = body.sampling_fields()
    shape = ResponseShape(plan, engine, who.user)
    lead = policy_for(
        state.settings.lead, state.lead_gate, caller, requested_mode(body.lead_updates, request.headers)
    )
    truncate = body.truncation == "auto"
    ask: TurnRequest
    conversation = body.conversation_id
    if conversation is not None:
        ask = ConversationTurn(
            user=who.user,
            params=params,
            fields=fields,
            stream=body.stream,
            truncate=truncate,
            conversation_id=conversation,
            instructions=body.instructions,
            new=[item_message(i) for i in plan.input_items],
            answer_item_id=plan.item_id,
            lead=lead,
        )
    else:
        ask = ResponseTurn(
            user=who.user,
            params=params,
            fields=fields,
            stream=body.stream,
            truncate=truncate,
            previous_response_id=body.previous_response_id,
            instructions=body.instructions,
            new=item_messages(items),
            store=body.store,
            lead=lead,
            route_key=route,
        )
    return await serve_turn(state, engine, request, ask, shape)


@router.get("/v1/responses/{response_id}", responses=error_responses(400, 401, 404))
def get_response(response_id: str, state: StateDep, principal: PrincipalDep) -> dict[str, Any]:
    """A stored response, as it was returned."""
    return response_body(state.store.responses.get(principal.user, response_id))


@router.delete("/v1/responses/{response_id}", responses=error_responses(400, 401, 404, 409))
def delete_response(
    response_id: str,
    state: StateDep,
    principal: PrincipalDep,
    cascade: bool = Query(default=False, description="also delete every response that continues it"),
) -> dict[str, Any]:
    """Delete a response and its version. A response that others continue (or that has versions
    committed on top of it) is not deleted: 409 naming them, unless `cascade=true`, which deletes
    them all (their stored dialogue holds this response)."""
    gone = state.store.responses.delete(principal.user, response_id, cascade=cascade)
    return {
        "id": response_id,
        "object": "response",
        "deleted": True,
        "deleted_response_ids": gone.response_ids,
        "deleted_versions": gone.versions,
    }


@router.get("/v1/responses/{response_id}/input_items", responses=error_responses(400, 401, 404))
def list_input_items(
    response_id: str,
    state: StateDep,
    principal: PrincipalDep,
    limit: int = Query(default=20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = Query(default=None, max_length=128),
) -> dict[str, Any]:
    """The input items the response was given (this request's, not the chain's), OpenAI's order."""
    items = list(state.store.responses.get(principal.user, response_id).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i.get("id") for i in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
