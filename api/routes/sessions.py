"""Sessions: create, list, read, delete, and the stateful `/messages` turn."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, status

from api.deps import EngineDep, PrincipalDep, StateDep, acting_principal
from api.errors import error_responses
from api.schemas import (
    BranchOut,
    ChatCompletion,
    Deleted,
    ListResponse,
    SessionCreate,
    SessionMessageRequest,
    SessionOut,
)
from api.turns import Turn, run_turn
from dss.dialogue.turns import message_target
from dss.dialogue.versions import SessionInfo

router = APIRouter(tags=["sessions"])

SidPath = Annotated[str, "session id"]


def session_out(s: SessionInfo) -> SessionOut:
    return SessionOut(
        id=s.id,
        created_at=s.created_at,
        updated_at=s.updated_at,
        system_prompt=s.system_prompt,
        metadata=s.metadata,
        version_count=s.version_count,
        branches=[
            BranchOut(name=b.name, head_version=b.head_version, created_at=b.created_at) for b in s.branches
        ],
    )


@router.post(
    "/v1/sessions",
    status_code=status.HTTP_201_CREATED,
    response_model=SessionOut,
    responses=error_responses(400, 401, 409, 413),
)
def create_session(body: SessionCreate, state: StateDep, principal: PrincipalDep) -> SessionOut:
    s = state.store.versions.create_session(
        principal.user, body.session_id, system_prompt=body.system_prompt, metadata=body.metadata
    )
    return session_out(s)


@router.get("/v1/sessions", response_model=ListResponse[SessionOut], responses=error_responses(400, 401))
def list_sessions(
    state: StateDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    after: Annotated[str | None, Query(max_length=128)] = None,
) -> ListResponse[SessionOut]:
    limit = min(limit, state.settings.limits.max_list_limit)
    rows, has_more = state.store.versions.list_sessions(principal.user, limit=limit, after=after)
    data = [session_out(s) for s in rows]
    return ListResponse[SessionOut](
        data=data,
        has_more=has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/v1/sessions/{session_id}", response_model=SessionOut, responses=error_responses(401, 404))
def get_session(session_id: str, state: StateDep, principal: PrincipalDep) -> SessionOut:
    return session_out(state.store.versions.get_session(principal.user, session_id))


@router.delete("/v1/sessions/{session_id}", response_model=Deleted, responses=error_responses(401, 404))
def delete_session(session_id: str, state: StateDep, principal: PrincipalDep) -> Deleted:
    """Delete the session, its branches and versions (see docs/privacy.md for its cached pages)."""
    state.store.delete_session(principal.user, session_id)
    return Deleted(id=session_id, object="session.deleted")


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
    principal: PrincipalDep,
    engine: EngineDep,
) -> Any:
    """Stateful mode: send only the new user message; the server continues the stored dialogue."""
    who = acting_principal(request, principal, body.user)
    target, base = await asyncio.to_thread(
        message_target, state.store.versions, who.user, session_id, body.branch, body.version
    )
    messages = [*base, {"role": "user", "content": body.text()}]
    return await run_turn(state, engine, Turn(who.user, messages, body, target), request)
