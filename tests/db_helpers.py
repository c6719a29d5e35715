"""Views of the metadata database that only tests need: how many rows a user has left.

They read the tables directly (an erasure must leave none), so production modules keep no
test-only API for them.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from dss.db import transaction
from dss.db.models import BranchRow, ResponseRow, SessionRow, VersionRow

# The newest migration (migrations/versions/): tests that upgrade to the head compare with it.
HEAD_REVISION = "0015_version_bytes_index"


def _count(db: Session, user: str) -> dict[str, int]:
    def count(table: type[SessionRow] | type[VersionRow] | type[BranchRow] | type[ResponseRow]) -> int:
        return db.scalar(select(func.count()).select_from(table).where(table.user_id == user)) or 0

    return {
        "sessions": count(SessionRow),
        "versions": count(VersionRow),
        "branches": count(BranchRow),
        "responses": count(ResponseRow),
    }


def count_user_rows(sf: sessionmaker[Session], user: str, db: Session | None = None) -> dict[str, int]:
    """How many sessions, versions, branches and stored responses `user` has (0s after an
    erasure); inside `db`'s transaction when given."""
    if db is not None:
        return _count(db, user)
    with transaction(sf) as own:
        return _count(own, user)


def user_ids_with_data(sf: sessionmaker[Session]) -> list[str]:
    """Every user with a session, in order."""
    with transaction(sf) as db:
        return list(db.scalars(select(SessionRow.user_id).distinct().order_by(SessionRow.user_id)))
