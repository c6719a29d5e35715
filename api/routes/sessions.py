"""Sessions: create, list, read, delete, and the stateful `/messages` turn."""

from __future__ import annotations

from typing import Annotated, Any, cast

from fastapi import APIRouter, Body, Query, Request, status

from api.deps import (
    CallerDep,
    EngineDep,
    PrincipalDep,
    SessionHeadersDep,
    StateDep,
    acting_principal,
    session_id_of,
)
from api.http_errors import error_responses
from api.shapes.chat_completion import ChatCompletionShape, turn_params
from api.shapes.openai_fields import HONOURED_CHAT, REFUSED, check_fields
from api.shapes.resources import (
    BranchOut,
    KvRetention,
    SessionCreate,
    SessionOut,
    SessionPatch,
    WarmOut,
    WarmRequest,
)
from api.shapes.schemas import ChatCompletion, Deleted, ListResponse, SessionMessageRequest, TierTokens
from api.state import AppState
from api.turn.request import MessageTurn
from api.turn.respond import serve_turn
from dss.dialogue.versions import SessionInfo
from dss.errors import ModelNotFound
from dss.ops.retention import KEEP
from dss.types import SessionId, UserId

router = APIRouter(tags=["sessions"])

SidPath = Annotated[str, "session id"]


def stored_bytes(state: AppState, user: UserId, session_id: SessionId) -> int:
    """The bytes `stored_bytes` shows (`Sessions.stored`: 0 for a session deleted meanwhile)."""
    return state.store.sessions.stored(user, session_id).nbytes


def session_out(s: SessionInfo, stored: int) -> SessionOut:
    return SessionOut(
        stored_bytes=stored,
        id=s.id,
        created_at=s.created_at,
        updated_at=s.updated_at,
        system_prompt=s.system_prompt,
        metadata=s.metadata,
        version_count=s.version_count,
        branches=[
            BranchOut(name=b.name, head_version=b.head_version, created_at=b.created_at) for b in s.branches
        ],
        kv_retention=cast(KvRetention, s.kv_retention),  # checked when it was stored
        kv_idle_ttl_s=s.kv_idle_ttl_s,
    )


@router.post(
    "/v1/sessions",
    status_code=status.HTTP_201_CREATED,
    response_model=SessionOut,
    responses=error_responses(400, 401, 409, 413),
)
def create_session(
    body: SessionCreate, state: StateDep, principal: PrincipalDep, session_headers: SessionHeadersDep
) -> SessionOut:
    session_id = session_id_of(body.session_id, session_headers, principal)
    store = state.store
    s = store.versions.create_session(
        principal.user,
        session_id,
        system_prompt=body.system_prompt,
        metadata=body.metadata,
        epoch=store.identity.epoch_of(principal.user),  # refused if the user is erased before it commits
    )
    return session_out(s, 0)  # no version yet, no KV


@router.get("/v1/sessions", response_model=ListResponse[SessionOut], responses=error_responses(400, 401))
def list_sessions(
    state: StateDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    after: Annotated[str | None, Query(max_length=128)] = None,
) -> ListResponse[SessionOut]:
    limit = min(limit, state.settings.limits.max_list_limit)
    rows, has_more = state.store.versions.list_sessions(
        principal.user, limit=limit, after=SessionId(after) if after is not None else None
    )
    data = [session_out(s, stored_bytes(state, principal.user, s.id)) for s in rows]
    return ListResponse[SessionOut](
        data=data,
        has_more=has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/v1/sessions/{session_id}", response_model=SessionOut, responses=error_responses(401, 404))
def get_session(session_id: str, state: StateDep, principal: PrincipalDep) -> SessionOut:
    sid = SessionId(session_id)
    s = state.store.versions.get_session(principal.user, sid)
    return session_out(s, stored_bytes(state, principal.user, sid))


@router.patch(
    "/v1/sessions/{session_id}", response_model=SessionOut, responses=error_responses(400, 401, 404, 409, 503)
)
def patch_session(
    session_id: str, body: SessionPatch, state: StateDep, principal: PrincipalDep
) -> SessionOut:
    """Set the session's KV retention hint and/or idle TTL (fields left out stay as they are).
    `409 pinned_cap_exceeded` when pinning would go over the pinned caps."""
    given = body.model_fields_set
    sid = SessionId(session_id)
    s = state.store.retention.set_hint(
        principal.user,
        sid,
        kv_retention=body.kv_retention if body.kv_retention is not None else KEEP,
        kv_idle_ttl_s=body.kv_idle_ttl_s if "kv_idle_ttl_s" in given else KEEP,
    )
    return session_out(s, stored_bytes(state, principal.user, sid))


@router.post(
    "/v1/sessions/{session_id}/warm",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=WarmOut,
    responses=error_responses(400, 401, 404),
)
def warm_session(
    session_id: str,
    state: StateDep,
    principal: PrincipalDep,
    body: Annotated[WarmRequest | None, Body()] = None,
) -> WarmOut:
    """Start promoting a version's KV pages from disk into the host tier (default: the head of
    `main`); answers at once with what is being warmed and where its tokens are now."""
    target = body if body is not None else WarmRequest()
    plan = state.store.retention.warmer.warm(
        principal.user, SessionId(session_id), version=target.version, branch=target.branch
    )
    return WarmOut(
        session_id=plan.session_id,
        version=plan.version,
        pages=plan.pages,
        tokens=plan.tokens,
        resident=TierTokens(**plan.resident),
        warming_pages=plan.warming_pages,
        warming_tokens=plan.warming_tokens,
        already_warming=plan.already_warming,
    )


@router.delete("/v1/sessions/{session_id}", response_model=Deleted, responses=error_responses(401, 404))
def delete_session(session_id: str, state: StateDep, principal: PrincipalDep) -> Deleted:
    """Delete the session, its branches and versions (see docs/privacy.md for its cached pages)."""
    state.store.sessions.delete(principal.user, SessionId(session_id))
    return Deleted(id=session_id, object="session.deleted")


# The fields of a `/messages` request that are DSS's own, not OpenAI's.
_MESSAGE_OWN = {"content", "branch", "version", "truncation"}
_MESSAGE_REFUSED = {**REFUSED, "messages": "stateful mode continues the stored dialogue: send `content`"}


@router.post(
    "/v1/sessions/{session_id}/messages",
    response_model=ChatCompletion,
    responses={
        **error_responses(400, 401, 404, 409, 413, 503),
        200: {"content": {"text/event-stream": {}}, "description": "A completion, or SSE chunks with stream"},
    },
)
async def post_message(
    session_id: str,
    body: SessionMessageRequest,
    request: Request,
    state: StateDep,
    caller: CallerDep,
    engine: EngineDep,
) -> Any:
    """Stateful mode: send only the new user message; the server continues the stored dialogue."""
    who = acting_principal(request, caller, body.user)
    if (
        body.model_extra
        and "model" in body.model_extra
        and body.model_extra["model"] not in engine.model_names
    ):
        raise ModelNotFound(f"the model {body.model_extra['model']!r} does not exist on this server")
    fields = body.request_fields(exclude=_MESSAGE_OWN)
    # The dialogue is the stored one: `messages` here would be silently replaced, so it is refused.
    check_fields(fields, own=(), honoured=HONOURED_CHAT - {"messages"}, refused=_MESSAGE_REFUSED)

    shape = ChatCompletionShape(engine, body.include_usage)
    ask = MessageTurn(
        user=who.user,
        params=turn_params(body),
        fields=fields,
        stream=bool(body.stream),
        truncate=body.truncation == "auto",
        session_id=SessionId(session_id),
        branch=body.branch,
        version=body.version,
        text=body.text(),
    )
    return await serve_turn(state, engine, request, ask, shape)
