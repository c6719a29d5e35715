"""The version tree of a session, one version's messages, and rollback."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import PrincipalDep, StateDep
from api.errors import error_responses
from api.schemas import BranchOut, ListResponse, RollbackRequest, TierTokens, VersionDetail, VersionOut
from api.state import AppState
from dss.dialogue.versions import VersionInfo
from dss.types import FingerprintId, Tier

router = APIRouter(tags=["versions"])


def _resident(state: AppState, user: str, v: VersionInfo) -> TierTokens:
    """Tokens of the version whose KV sits in each tier now (nothing for an unknown model)."""
    if not v.fingerprint or v.fingerprint not in state.store.fingerprints or v.n_tokens == 0:
        return TierTokens()
    tenant = state.store.tenant_for(user)
    split = state.store.residency(FingerprintId(v.fingerprint), tenant, v.tokens)
    return TierTokens(**{t.value: split.get(t.value, 0) for t in Tier})


def _out(state: AppState, user: str, v: VersionInfo) -> VersionOut:
    return VersionOut(
        number=v.number,
        parent=v.parent,
        branch=v.branch,
        created_at=v.created_at,
        n_tokens=v.n_tokens,
        resident=_resident(state, user, v),
    )


@router.get(
    "/v1/sessions/{session_id}/versions",
    response_model=ListResponse[VersionOut],
    responses=error_responses(401, 404),
)
def list_versions(session_id: str, state: StateDep, principal: PrincipalDep) -> ListResponse[VersionOut]:
    """Every version (also those no branch points at any more), with where its KV lives now."""
    rows = state.store.versions.list_versions(principal.user, session_id, with_body=True)
    data = [_out(state, principal.user, v) for v in rows]
    return ListResponse[VersionOut](data=data, has_more=False)


@router.get(
    "/v1/sessions/{session_id}/versions/{number}",
    response_model=VersionDetail,
    responses=error_responses(400, 401, 404),
)
def get_version(session_id: str, number: int, state: StateDep, principal: PrincipalDep) -> VersionDetail:
    v = state.store.versions.get_version(principal.user, session_id, number)
    return VersionDetail(**_out(state, principal.user, v).model_dump(), messages=v.messages)


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
        session_id,
        body.branch,
        body.to_version,
        expected_head=body.expected_head,
    )
    return BranchOut(name=b.name, head_version=b.head_version, created_at=b.created_at)
