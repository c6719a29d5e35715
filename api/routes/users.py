"""Erasing a user (admin, or the user themself) and reading erasure receipts."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query

from api.auth import check_user_id
from api.deps import PrincipalDep, StateDep
from api.errors import Forbidden, error_responses
from api.schemas import (
    ErasureFleetOut,
    ErasureReceiptOut,
    ErasureReceiptSummary,
    ListResponse,
    VerificationOut,
)
from api.state import AppState
from dss.errors import ReceiptNotFound
from dss.ops.erasure import ErasureReceipt
from dss.types import TenantId

router = APIRouter(tags=["users"])


def receipt_out(state: AppState, r: ErasureReceipt) -> ErasureReceiptOut:
    v = state.store.verify_erasure(r.id)
    return ErasureReceiptOut(
        id=r.id,
        erased_at=r.erased_at,
        subject=r.subject,
        counts=r.counts,
        database_scrubbed=r.database_scrubbed,
        fleet=(
            ErasureFleetOut(servers=r.fleet.servers, unanswered=list(r.fleet.unanswered))
            if r.fleet is not None
            else None
        ),
        verification=VerificationOut(
            checked_at=v.checked_at,
            remnants=v.remnants,
            chain_ok=v.chain_ok,
            details=list(v.details),
            database_scrubbed=v.database_scrubbed,
        ),
    )


@router.delete(
    "/v1/users/{user_id}", response_model=ErasureReceiptOut, responses=error_responses(400, 401, 403)
)
async def erase_user(user_id: str, state: StateDep, principal: PrincipalDep) -> ErasureReceiptOut:
    """Erase everything the server holds of a user; the receipt is verified before it is returned.
    The user's generations still running are stopped first (none of them commits a version), and
    again once the erasure committed (those that started meanwhile); a turn of the user that was
    not generating then (being prepared, or committing) is refused at its commit instead."""
    check_user_id(user_id)
    if not principal.is_admin and principal.user != user_id:
        raise Forbidden("only an admin key or the user themself may erase a user")
    store = state.store
    if state.engine is not None:
        await state.engine.abort_tenant(store.tenant_for(user_id))
    receipt = await asyncio.to_thread(store.erase_user, user_id)
    if state.engine is not None:
        await state.engine.abort_tenant(TenantId(receipt.subject))
    state.metrics.erasures.inc()
    return await asyncio.to_thread(receipt_out, state, receipt)


@router.get(
    "/v1/erasures",
    response_model=ListResponse[ErasureReceiptSummary],
    responses=error_responses(400, 401, 403, 404),
)
def list_erasures(
    state: StateDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    after: Annotated[str | None, Query(max_length=64)] = None,
) -> ListResponse[ErasureReceiptSummary]:
    """Every erasure receipt, newest first (admins only: the subjects are other users')."""
    if not principal.is_admin:
        raise Forbidden("only an admin key may list erasure receipts")
    limit = min(limit, state.settings.limits.max_list_limit)
    rows, has_more = state.store.list_receipts(limit, after)
    data = [
        ErasureReceiptSummary(id=r.id, erased_at=r.erased_at, subject=r.subject, counts=r.counts)
        for r in rows
    ]
    return ListResponse[ErasureReceiptSummary](data=data, has_more=has_more)


@router.get(
    "/v1/erasures/{receipt_id}", response_model=ErasureReceiptOut, responses=error_responses(401, 404)
)
def get_erasure(receipt_id: str, state: StateDep, principal: PrincipalDep) -> ErasureReceiptOut:
    """The receipt with a fresh verification (admins: any; users: their own)."""
    store = state.store
    receipt = store.get_receipt(receipt_id)
    if not principal.is_admin and receipt.subject not in store.receipt_subjects(principal.user):
        raise ReceiptNotFound(f"no erasure receipt {receipt_id!r}")
    return receipt_out(state, receipt)
