"""The API's own tables as the store must reach them (`dss.store.ApiTables`): `dss` never
imports `api`, so the API passes this to `Store.open`, and the store calls it inside its own
transactions (the tenant-derivation upgrade at open, an erasure). The tables stay the API's
(`api` owns `api_keys` and `admin_audit`, `dss.db.models.TABLE_OWNERS`)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from dss.db.models import AdminAuditRow, ApiKeyRow
from dss.types import UserId


def _replaced(value: Any, user: str, pseudonym: str) -> Any:
    """`value` (JSON) with every string equal to `user` replaced by `pseudonym`."""
    if isinstance(value, str):
        return pseudonym if value == user else value
    if isinstance(value, list):
        return [_replaced(v, user, pseudonym) for v in value]
    if isinstance(value, dict):
        return {k: _replaced(v, user, pseudonym) for k, v in value.items()}
    return value


class StoreTables:
    """`dss.store.ApiTables` over the API's keys and admin audit trail. Stateless."""

    def users_in(self, db: Session) -> set[UserId]:
        return {UserId(u) for u in db.scalars(select(ApiKeyRow.user_id).distinct()) if u}

    def pseudonymise_audit_in(self, db: Session, user: UserId, pseudonym: str) -> int:
        """In the erasure's transaction: the admin audit entries whose detail names `user`
        (`"user"`: the user a key was created for) name `pseudonym` instead; returns how many.
        The trail is otherwise never changed; this keeps who did what to which key, not to whom.
        Idempotent. Reads the entries that name the user (the trail is as long as the admin
        operations)."""
        rows = db.scalars(select(AdminAuditRow).where(AdminAuditRow.detail["user"].as_string() == user))
        n = 0
        for row in rows:
            row.detail = _replaced(dict(row.detail), user, pseudonym)
            n += 1
        db.flush()
        return n
