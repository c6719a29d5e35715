"""The admin audit trail: who (an admin key's id, `cli` for the `dss keys` command, `dev` for
development mode) created or revoked a key, created or changed a frontend, and when.

Invariant: an entry is written in the same transaction as the change it records (`record` takes
the caller's open session), so there is no change without its entry and no entry for a change
that rolled back. Entries are never deleted, and updated only by an erasure: they name keys by
id and users by the id the key acts as (never a secret), and the erasure of a user names it
`erased:<tenant>` instead, in its transaction (`api.keys.store_tables`, which the store's
`Eraser` calls).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import transaction
from dss.db.models import AdminAuditRow, aware

ACTOR_CLI = "cli"
ACTOR_DEV = "dev"


class AuditAction(enum.StrEnum):
    KEY_CREATED = "key.created"
    KEY_REVOKED = "key.revoked"
    FRONTEND_CREATED = "frontend.created"
    FRONTEND_CHANGED = "frontend.changed"


@dataclass(frozen=True, slots=True)
class AuditEntry:
    id: int
    at: datetime
    actor: str
    action: AuditAction
    subject: str  # a key id or a frontend name
    detail: dict[str, Any]


def record(db: Session, actor: str, action: AuditAction, subject: str, detail: dict[str, Any]) -> None:
    """Add an entry inside the caller's transaction (the one that makes the change)."""
    db.add(AdminAuditRow(actor=actor, action=action.value, subject=subject, detail=detail))


class AuditTrail:
    """Reads the `admin_audit` table."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._sf = session_factory

    def list(self, limit: int = 100, before: int | None = None) -> tuple[list[AuditEntry], bool]:
        """Up to `limit` entries, newest first, older than entry `before` if given; and whether
        there are more."""
        query = select(AdminAuditRow).order_by(AdminAuditRow.id.desc()).limit(limit + 1)
        if before is not None:
            query = query.where(AdminAuditRow.id < before)
        with transaction(self._sf) as db:
            rows = [
                AuditEntry(r.id, aware(r.at), r.actor, AuditAction(r.action), r.subject, dict(r.detail))
                for r in db.scalars(query)
            ]
        return rows[:limit], len(rows) > limit
