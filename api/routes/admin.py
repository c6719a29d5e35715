"""Key administration over REST (admin keys only): API keys (the secret shown once), frontends
and their trusted headers and lead-update settings, the audit trail of who changed which, and
the lead-update quality gate's figures.

Every change is audited in its own transaction (`api.keys.audit`), naming the admin key that
asked (`dev` in development mode). A frontend key is refused here (403) like a user key.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Query, status

from api.deps import AdminDep, StateDep
from api.http_errors import error_responses
from api.keys.api_keys import ApiKeys, CreatedKey, KeyInfo
from api.keys.audit import AuditTrail
from api.keys.frontends import KEEP, Frontend, Frontends
from api.shapes.admin import (
    AuditEntryOut,
    FrontendCreate,
    FrontendOut,
    FrontendPatch,
    KeyCreate,
    KeyCreatedOut,
    KeyOut,
    LeadGateOut,
)
from api.shapes.schemas import ListResponse
from dss.errors import ApiKeyNotFound

router = APIRouter(tags=["admin"])
log = logging.getLogger("dss.api.admin")


def key_out(k: KeyInfo) -> KeyOut:
    return KeyOut(
        id=k.id,
        kind=k.kind,
        user=k.user,
        frontend=k.frontend,
        created_at=k.created_at,
        revoked_at=k.revoked_at,
    )


def frontend_out(f: Frontend) -> FrontendOut:
    return FrontendOut(
        name=f.name,
        user_headers=list(f.user_headers),
        session_header=f.session_header,
        lead_updates=f.lead_updates,
        volatile_patterns=list(f.volatile_patterns),
        trust_dss_user_header=f.trust_dss_user_header,
        trust_body_user=f.trust_body_user,
        created_at=f.created_at,
        created_by=f.created_by,
    )


def create_key(
    keys: ApiKeys, frontends: Frontends, body: KeyCreate, actor: str
) -> tuple[CreatedKey, KeyInfo]:
    """The new key (a frontend key's frontend registered first if it is not), and its listing."""
    if body.frontend is not None:
        frontends.ensure(body.frontend, actor)
    created = keys.create(body.user, admin=body.admin, frontend=body.frontend, actor=actor)
    return created, keys.get(created.id)


@router.post(
    "/v1/admin/keys",
    status_code=status.HTTP_201_CREATED,
    response_model=KeyCreatedOut,
    responses=error_responses(400, 401, 403, 409),
)
async def post_key(body: KeyCreate, state: StateDep, admin: AdminDep) -> KeyCreatedOut:
    """Create a key; the answer holds its secret, shown only here."""
    frontends = Frontends(state.store.sf)
    created, info = await asyncio.to_thread(create_key, state.keys, frontends, body, admin.actor)
    return KeyCreatedOut(**key_out(info).model_dump(exclude={"object"}), key=created.key)


@router.get("/v1/admin/keys", response_model=ListResponse[KeyOut], responses=error_responses(401, 403))
def list_keys(state: StateDep, _admin: AdminDep) -> ListResponse[KeyOut]:
    """Every key, revoked ones included (ids and owners; never a secret)."""
    return ListResponse[KeyOut](data=[key_out(k) for k in state.keys.list()])


@router.delete("/v1/admin/keys/{key_id}", response_model=KeyOut, responses=error_responses(401, 403, 404))
def revoke_key(key_id: str, state: StateDep, admin: AdminDep) -> KeyOut:
    """Revoke a key; every server stops accepting it within its key cache's lifetime. 404 for
    no key of that id, or one revoked already."""
    if not state.keys.revoke(key_id, actor=admin.actor):
        raise ApiKeyNotFound(f"no active API key {key_id!r}")
    return key_out(state.keys.get(key_id))


@router.post(
    "/v1/admin/frontends",
    status_code=status.HTTP_201_CREATED,
    response_model=FrontendOut,
    responses=error_responses(400, 401, 403, 409),
)
def post_frontend(body: FrontendCreate, state: StateDep, admin: AdminDep) -> FrontendOut:
    """Register a frontend: the headers its keys trust to name the end user and the session.
    409 when the name is registered, or stored data holds users named `<name>/...`."""
    f = Frontends(state.store.sf).create(
        body.name,
        body.user_headers,
        body.session_header,
        admin.actor,
        body.lead_updates,
        body.volatile_patterns,
        body.trust_dss_user_header,
        body.trust_body_user,
    )
    return frontend_out(f)


@router.get(
    "/v1/admin/frontends", response_model=ListResponse[FrontendOut], responses=error_responses(401, 403)
)
def list_frontends(state: StateDep, _admin: AdminDep) -> ListResponse[FrontendOut]:
    data = [frontend_out(f) for f in Frontends(state.store.sf).list()]
    return ListResponse[FrontendOut](data=data, first_id=data[0].name if data else None,
                                     last_id=data[-1].name if data else None)  # fmt: skip


@router.patch(
    "/v1/admin/frontends/{name}", response_model=FrontendOut, responses=error_responses(400, 401, 403, 404)
)
def patch_frontend(name: str, body: FrontendPatch, state: StateDep, admin: AdminDep) -> FrontendOut:
    """Change a frontend's trusted headers and sources or lead-update settings (fields left out stay;
    `lead_updates: null` goes back to the server's setting); its keys follow at once on
    this server, on others within their key cache's lifetime."""
    given = body.model_fields_set
    f = Frontends(state.store.sf).update(
        name,
        admin.actor,
        user_headers=body.user_headers if body.user_headers is not None else KEEP,
        session_header=body.session_header if "session_header" in given else KEEP,
        lead_updates=body.lead_updates if "lead_updates" in given else KEEP,
        volatile_patterns=body.volatile_patterns if body.volatile_patterns is not None else KEEP,
        trust_dss_user_header=KEEP if body.trust_dss_user_header is None else body.trust_dss_user_header,
        trust_body_user=KEEP if body.trust_body_user is None else body.trust_body_user,
    )
    state.keys.forget_cached()
    return frontend_out(f)


@router.get(
    "/v1/admin/audit", response_model=ListResponse[AuditEntryOut], responses=error_responses(400, 401, 403)
)
def list_audit(
    state: StateDep,
    _admin: AdminDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    before: Annotated[
        int | None, Query(ge=1, le=2**31 - 1, description="an entry id: only older entries")
    ] = None,
) -> ListResponse[AuditEntryOut]:
    """The audit trail of keys and frontends, newest first."""
    limit = min(limit, state.settings.limits.max_list_limit)
    entries, has_more = AuditTrail(state.store.sf).list(limit, before)
    data = [
        AuditEntryOut(
            id=str(e.id), at=e.at, actor=e.actor, action=e.action.value, subject=e.subject, detail=e.detail
        )
        for e in entries
    ]
    return ListResponse[AuditEntryOut](data=data, has_more=has_more)


@router.get(
    "/v1/admin/lead-gate", response_model=ListResponse[LeadGateOut], responses=error_responses(401, 403)
)
def lead_gate(state: StateDep, _admin: AdminDep) -> ListResponse[LeadGateOut]:
    """The lead-update quality gate's figures per frontend, on this server (docs/frontends.md)."""
    data = [LeadGateOut(**asdict(f)) for f in state.lead_gate.figures()]
    return ListResponse[LeadGateOut](data=data)


@router.post(
    "/v1/admin/lead-gate/{frontend}/reset", response_model=LeadGateOut, responses=error_responses(401, 403)
)
def reset_lead_gate(frontend: str, state: StateDep, admin: AdminDep) -> LeadGateOut:
    """Re-arm a frontend's lead updates on this server, with fresh figures."""
    was = state.lead_gate.reset(frontend)
    if was:
        state.metrics.lead_gate_tripped.dec()
    log.warning("lead-update quality gate of %s re-armed by %s (was tripped: %s)", frontend, admin.actor, was)
    return LeadGateOut(frontend=frontend, checks=0, first_token_agreement=None, prefix_agreement=None,
                       mean_distance=None, tripped=False)  # fmt: skip
