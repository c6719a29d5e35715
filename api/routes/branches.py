"""Branches of a session: create one at any version, list them."""

from __future__ import annotations

from fastapi import APIRouter, status

from api.deps import PrincipalDep, StateDep
from api.http_errors import error_responses
from api.shapes.resources import BranchCreate, BranchOut
from api.shapes.schemas import ListResponse
from dss.dialogue.versions import BranchInfo
from dss.types import SessionId

router = APIRouter(tags=["branches"])


def _out(b: BranchInfo) -> BranchOut:
    return BranchOut(name=b.name, head_version=b.head_version, created_at=b.created_at)


@router.post(
    "/v1/sessions/{session_id}/branches",
    status_code=status.HTTP_201_CREATED,
    response_model=BranchOut,
    responses=error_responses(400, 401, 404, 409),
)
async def create_branch(
    session_id: str, body: BranchCreate, state: StateDep, principal: PrincipalDep
) -> BranchOut:
    versions = state.store.versions
    return _out(
        await state.short_db_op(
            versions.branch, principal.user, SessionId(session_id), body.from_version, body.name
        )
    )


@router.get(
    "/v1/sessions/{session_id}/branches",
    response_model=ListResponse[BranchOut],
    responses=error_responses(401, 404),
)
def list_branches(session_id: str, state: StateDep, principal: PrincipalDep) -> ListResponse[BranchOut]:
    data = [_out(b) for b in state.store.versions.list_branches(principal.user, SessionId(session_id))]
    return ListResponse[BranchOut](
        data=data,
        has_more=False,
        first_id=data[0].name if data else None,
        last_id=data[-1].name if data else None,
    )
