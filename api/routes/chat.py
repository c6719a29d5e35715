"""`POST /v1/chat/completions`: OpenAI-compatible chat, session-aware when `session_id` is given
(in the body, or as the `X-DSS-Session` header a router hashes on, vLLM's `X-Session-ID`, or a
frontend key's session header; `api.deps.session_id_of`).

The request takes its generation slot on arrival, and a client that goes away stops its
generation (`api.turn.respond`, shared with the stateful `/messages` route and Responses).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from api.deps import CallerDep, EngineDep, SessionHeadersDep, StateDep, acting_principal, session_id_of
from api.http_errors import BadRequest, error_responses
from api.shapes.chat_completion import ChatCompletionShape, turn_params
from api.shapes.openai_fields import check_fields
from api.shapes.schemas import ChatCompletion, ChatCompletionRequest
from api.turn.lead import policy_for, requested_mode
from api.turn.request import ChatTurn
from api.turn.respond import serve_turn
from dss.dialogue.lead.match import content_session_id
from dss.errors import ModelNotFound

router = APIRouter(tags=["chat"])

# DSS's own fields of a chat request; `messages` goes to vLLM as the stored (plain) messages.
_CHAT_OWN = {"session_id", "state_version", "messages", "safety_identifier", "lead_updates"}


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={
        **error_responses(400, 401, 404, 409, 413, 503),
        200: {"content": {"text/event-stream": {}}, "description": "A completion, or SSE chunks with stream"},
    },
)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    state: StateDep,
    caller: CallerDep,
    engine: EngineDep,
    session_headers: SessionHeadersDep,
) -> Any:
    """Chat; with a session id, the turn is committed as a new version of that session."""
    who = acting_principal(request, caller, body.user, body.safety_identifier)
    session_id = session_id_of(body.session_id, session_headers, who)
    if body.state_version is not None and session_id is None:
        raise BadRequest("state_version needs a session_id", code="invalid_request", param="state_version")
    if body.model and body.model not in engine.model_names:
        raise ModelNotFound(f"the model {body.model!r} does not exist on this server")

    fields = body.request_fields(exclude=_CHAT_OWN)
    check_fields(fields, own=())

    messages = [m.plain() for m in body.messages]
    lead = policy_for(
        state.settings.lead, state.lead_gate, caller, requested_mode(body.lead_updates, request.headers)
    )
    if session_id is None and lead.mode != "off":
        # A chat that names no session is named by its content, so its turns find each other.
        session_id = content_session_id(messages)
    shape = ChatCompletionShape(engine, body.include_usage)
    ask = ChatTurn(
        user=who.user,
        params=turn_params(body),
        fields=fields,
        stream=bool(body.stream),
        messages=messages,
        session_id=session_id,
        state_version=body.state_version,
        lead=lead,
    )
    return await serve_turn(state, engine, request, ask, shape)
