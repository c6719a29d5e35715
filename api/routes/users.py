"""Erasing a user (admin, the user's frontend, or the user themself), listing users (admin, or a
frontend its own end users) and reading erasure receipts.

Both answers carry a fresh verification of the receipt. A user's erasure checks (self-erasure,
`GET /v1/erasures/{id}`) share one token bucket (`limits.erasure_checks_*`; 429 beyond it), and
the erasures of one key another (`limits.erasures_per_key_*`): a frontend key names any end-user
id, so per-user buckets alone would let it erase ids at full speed. Admin keys are not limited:
the operator's batch erasures and audits are theirs to schedule, and an admin key can erase every
user anyway, so a limit would protect nothing from it; a user's key is what any signed-up user
holds.

An erasure of a user of whom the server holds nothing answers `held_nothing: true` and writes no
receipt (`Eraser.erase_if_held`): receipts are permanent, and ids that hold nothing are free to
name.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query

from api.auth import Caller, Principal
from api.deps import CallerDep, PrincipalDep, StateDep
from api.http_errors import Forbidden, RateLimited, error_responses
from api.keys.api_keys import ApiKeys
from api.keys.frontends import end_user_id, end_user_prefix
from api.shapes.resources import (
    ErasureFleetOut,
    ErasureNothingHeldOut,
    ErasureReceiptOut,
    ErasureReceiptSummary,
    UserOut,
    VerificationOut,
)
from api.shapes.schemas import ListResponse
from api.state import AppState
from dss.dialogue.users import stored_users
from dss.errors import InvalidUserId, ReceiptNotFound
from dss.inputs import DOT_SEGMENTS, check_stored_user_id, check_user_id
from dss.ops.erasure.receipts import ErasureReceipt
from dss.ops.erasure.verify import Verification
from dss.store import Store
from dss.types import TenantId, UserId

router = APIRouter(tags=["users"])


def check_key_rate(state: AppState, caller: Caller) -> None:
    """Take one of the caller's key's erasure tokens, or refuse with 429 (admins: no limit)."""
    if caller.is_admin or caller.key_id is None:  # no key: development mode, whose callers are admins
        return
    wait_s = state.erasures_per_key.take(caller.key_id)
    if wait_s:
        raise RateLimited(f"too many erasures with this key; retry in {wait_s} s", wait_s)


def check_rate(state: AppState, principal: Principal) -> None:
    """Take one of the principal's erasure-check tokens, or refuse with 429 (admins: no limit)."""
    if principal.is_admin:
        return
    wait_s = state.erasure_checks.take(principal.user)
    if wait_s:
        raise RateLimited(f"too many erasure checks for this user; retry in {wait_s} s", wait_s)


def receipt_out(store: Store, r: ErasureReceipt) -> ErasureReceiptOut:
    """The receipt with a fresh verification, as the API (and `dss users erase`) shows it."""
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
        verification=verification_out(store.eraser.verify(r.id)),
    )


def verification_out(v: Verification) -> VerificationOut:
    return VerificationOut(
        checked_at=v.checked_at,
        remnants=v.remnants,
        chain_ok=v.chain_ok,
        details=list(v.details),
        database_scrubbed=v.database_scrubbed,
    )


def erasable_user(store: Store, keys: ApiKeys, user: str) -> UserId:
    """`user` if it may be erased: an id of today's alphabet, or one outside it that the store
    holds (made before the rule: `org/alice`); else `InvalidUserId` naming the rule. Any id an
    earlier version may have stored stays erasable; an unknown one breaking the rule (a typo such
    as `alice/`) is refused rather than answered with an empty receipt. Reads the database."""
    stored = check_stored_user_id(user)
    try:
        return check_user_id(stored)
    except InvalidUserId:
        if holds(store, keys, stored):
            return stored
        raise


def holds(store: Store, keys: ApiKeys, user: UserId) -> bool:
    """Whether the store or the key table holds anything of `user`. Reads the database."""
    return keys.holds_user(user) or store.eraser.holds_user(user)


# `:path`: a user id made before ids lost `/` (`org/alice`) must still reach its erasure, whether
# the client sends the slash encoded (`org%2Falice`, decoded before routing) or raw.
@router.delete(
    "/v1/users/{user_id:path}",
    response_model=ErasureReceiptOut | ErasureNothingHeldOut,
    responses=error_responses(400, 401, 403, 429),
)
async def erase_user(
    user_id: str, state: StateDep, caller: CallerDep
) -> ErasureReceiptOut | ErasureNothingHeldOut:
    """Erase everything the server holds of a user; the receipt is verified before it is returned.
    The user's generations still running are stopped first (none of them commits a version), and
    again once the erasure committed (those that started meanwhile); a turn of the user that was
    not generating then (being prepared, or committing) is refused at its commit instead.

    An admin key names any user (an id outside today's alphabet is erased when the store holds
    it: `erasable_user`); a frontend key one of its end users, by the end-user id; a user key
    itself.

    A user of whom the server holds nothing is answered `held_nothing: true`, with no receipt
    (`Eraser.erase_if_held`); writes of the user still in flight are refused all the same."""
    return await _erase(user_id, "the user id in the path", state, caller)


# The same, with the id in the query: users `.` and `..` (made before ids excluded them) cannot be
# named in a path, which clients normalise away even percent-encoded (`%2E%2E`).
@router.delete(
    "/v1/users",
    response_model=ErasureReceiptOut | ErasureNothingHeldOut,
    responses=error_responses(400, 401, 403, 429),
)
async def erase_user_by_query(
    state: StateDep,
    caller: CallerDep,
    user_id: Annotated[str, Query(alias="id", max_length=1024, description="the user id, as in the path")],
) -> ErasureReceiptOut | ErasureNothingHeldOut:
    """`DELETE /v1/users/{user_id}` with the id as the query's `id`: for an id no URL path can
    carry (`.`, `..`)."""
    return await _erase(user_id, "the id query parameter", state, caller)


async def _erase(
    user_id: str, source: str, state: AppState, caller: Caller
) -> ErasureReceiptOut | ErasureNothingHeldOut:
    store = state.store
    if caller.frontend is None and not caller.is_admin and caller.user != user_id:
        raise Forbidden("only an admin key, the user's frontend or the user themself may erase a user")
    # Rate first: a refused caller costs no thread nor database read (`erasable_user` reads it).
    check_key_rate(state, caller)
    if caller.frontend is not None:  # one of its end users, by the end-user id
        try:
            user = end_user_id(caller.frontend.name, user_id, source)
            old = False
        except InvalidUserId:
            if user_id not in DOT_SEGMENTS:
                raise
            # An end user `.` or `..` made before the rule: erased when the store holds them.
            user, old = UserId(end_user_prefix(caller.frontend.name) + user_id), True
        check_rate(state, Principal(user, False, caller.key_id))
        if old and not await asyncio.to_thread(holds, store, state.keys, user):
            end_user_id(caller.frontend.name, user_id, source)  # the rule's `InvalidUserId`
    else:
        check_rate(state, caller.as_principal())
        user = await asyncio.to_thread(erasable_user, store, state.keys, user_id)
    if state.engine is not None:
        await state.engine.abort_tenant(store.identity.tenant_for(user))
    receipt = await asyncio.to_thread(store.eraser.erase_if_held, user)
    if receipt is None:
        return ErasureNothingHeldOut(checked_at=datetime.now(UTC))
    if state.engine is not None:
        await state.engine.abort_tenant(TenantId(receipt.subject))
    state.metrics.erasures.inc()
    return await asyncio.to_thread(receipt_out, store, receipt)


@router.get("/v1/users", response_model=ListResponse[UserOut], responses=error_responses(400, 401, 403))
def list_users(
    state: StateDep,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[str | None, Query(max_length=256)] = None,
) -> ListResponse[UserOut]:
    """The users that hold sessions or stored responses, in id order: an admin key sees every
    user; a frontend key its own end users, by their end-user ids (`after` is one of those too)."""
    if caller.frontend is None and not caller.is_admin:
        raise Forbidden("only an admin key or a frontend key may list users")
    limit = min(limit, state.settings.limits.max_list_limit)
    prefix = end_user_prefix(caller.frontend.name) if caller.frontend is not None else ""
    ids, has_more = stored_users(state.store.sf, prefix, limit, prefix + after if after is not None else None)
    return ListResponse[UserOut](data=[UserOut(id=u[len(prefix) :]) for u in ids], has_more=has_more)


@router.get(
    "/v1/erasures",
    response_model=ListResponse[ErasureReceiptSummary],
    responses=error_responses(400, 401, 403, 404),
)
def list_erasures(
    state: StateDep,
    caller: CallerDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    after: Annotated[str | None, Query(max_length=64)] = None,
) -> ListResponse[ErasureReceiptSummary]:
    """Every erasure receipt, newest first (admins only: the subjects are other users')."""
    if not caller.is_admin:
        raise Forbidden("only an admin key may list erasure receipts")
    limit = min(limit, state.settings.limits.max_list_limit)
    rows, has_more = state.store.eraser.list_receipts(limit, after)
    data = [
        ErasureReceiptSummary(id=r.id, erased_at=r.erased_at, subject=r.subject, counts=r.counts)
        for r in rows
    ]
    return ListResponse[ErasureReceiptSummary](data=data, has_more=has_more)


@router.get(
    "/v1/erasures/{receipt_id}", response_model=ErasureReceiptOut, responses=error_responses(401, 404, 429)
)
def get_erasure(receipt_id: str, state: StateDep, principal: PrincipalDep) -> ErasureReceiptOut:
    """The receipt with a fresh verification (admins: any; users: their own; a frontend key: its
    end user's, named as on every user route, e.g. by `X-DSS-User`)."""
    store = state.store
    receipt = store.eraser.get_receipt(receipt_id)
    if not principal.is_admin and receipt.subject not in store.identity.receipt_subjects(principal.user):
        raise ReceiptNotFound(f"no erasure receipt {receipt_id!r}")
    check_rate(state, principal)
    return receipt_out(store, receipt)
