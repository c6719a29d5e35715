"""The version tree of a session, one version's messages, and rollback."""

from __future__ import annotations

from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query

from api.deps import PrincipalDep, StateDep
from api.http_errors import error_responses
from api.shapes.resources import BranchOut, RollbackRequest, VersionDetail, VersionOut
from api.shapes.schemas import ListResponse, TierTokens
from api.state import AppState
from dss.dialogue.versions import VersionSummary
from dss.types import SessionId, UserId

router = APIRouter(tags=["versions"])


def _resident(state: AppState, user: UserId, fingerprint: str | None, tokens: np.ndarray) -> TierTokens:
    """Tokens of the version whose KV sits in each tier now (`Sessions.resident`)."""
    return TierTokens(**state.store.sessions.resident(user, fingerprint, tokens))


def _out(v: VersionSummary, resident: TierTokens) -> VersionOut:
    return VersionOut(
        number=v.number,
        parent=v.parent,
        branch=v.branch,
        created_at=v.created_at,
        n_tokens=v.n_tokens,
        resident=resident,
    )


@router.get(
    "/v1/sessions/{session_id}/versions",
    response_model=ListResponse[VersionOut],
    responses=error_responses(400, 401, 404),
)
def list_versions(
    session_id: str,
    state: StateDep,
    principal: PrincipalDep,
    limit: Annotated[int | None, Query(ge=1, le=1000)] = None,
    after: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
) -> ListResponse[VersionOut]:
    """The versions by number (also those no branch points at any more), with where their KV
    lives now; `limit` at a time (default and maximum `limits.max_list_limit`) after version
    `after`. The page's token ids are read a few versions at a time, never the whole tree's."""
    cap = state.settings.limits.max_list_limit
    limit = min(limit if limit is not None else cap, cap)
    start = after if after is not None else 0
    user, sid = principal.user, SessionId(session_id)
    rows, has_more = state.store.versions.version_page(user, sid, limit=limit, after=start)
    resident = state.store.sessions.resident_versions(user, sid, start, rows[-1].number) if rows else {}
    data = [_out(v, TierTokens(**resident[v.number]) if v.number in resident else TierTokens()) for v in rows]
    return ListResponse[VersionOut](data=data, has_more=has_more)


@router.get(
    "/v1/sessions/{session_id}/versions/{number}",
    response_model=VersionDetail,
    responses=error_responses(400, 401, 404),
)
def get_version(session_id: str, number: int, state: StateDep, principal: PrincipalDep) -> VersionDetail:
    v = state.store.versions.get_version(principal.user, SessionId(session_id), number)
    resident = _resident(state, principal.user, v.fingerprint, v.tokens)
    return VersionDetail(**_out(v, resident).model_dump(), messages=v.messages)


@router.post(
    "/v1/sessions/{session_id}/rollback",
    response_model=BranchOut,
    responses=error_responses(400, 401, 404, 409),
)
async def rollback(
    session_id: str, body: RollbackRequest, state: StateDep, principal: PrincipalDep
) -> BranchOut:
    """Move a branch's head back to one of its ancestors; later versions stay listed."""
    b = await state.short_db_op(
        state.store.versions.rollback,
        principal.user,
        SessionId(session_id),
        body.branch,
        body.to_version,
        expected_head=body.expected_head,
    )
    return BranchOut(name=b.name, head_version=b.head_version, created_at=b.created_at)
