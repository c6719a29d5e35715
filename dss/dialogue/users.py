"""The users the dialogue state names: every user id with a session or a stored response; and,
for an erasure's verification, the rows of one user still there (`rows_created_by`).

A user exists in the store by what it holds (there is no table of users): sessions and stored
responses name their owner in clear; data keys and erasure epochs name only salted hashes, so
they cannot be listed. An erased user holds no session nor response, and so is not listed.

`prefix` selects the users whose id starts with it: a frontend's end users are the DSS users
`<frontend>/<end user>` (`api.keys.frontends`), listed with the prefix `<frontend>/`. The prefix
is compared as a string (`substr`), never as a `LIKE` pattern: `_` and `%` are ordinary here.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from sqlalchemy import ColumnElement, func, select, true, union
from sqlalchemy.orm import InstrumentedAttribute, Session, sessionmaker

from dss.db.connect import transaction
from dss.db.models import ResponseRow, SessionRow
from dss.types import UserId


def _starts_with(column: InstrumentedAttribute[str], prefix: str) -> ColumnElement[bool]:
    return func.substr(column, 1, len(prefix)) == prefix


def stored_users(
    sf: sessionmaker[Session], prefix: str = "", limit: int = 100, after: str | None = None
) -> tuple[list[UserId], bool]:
    """Up to `limit` user ids starting with `prefix`, in id order, after `after` (a full id);
    and whether there are more."""
    ids = union(
        *(
            select(table.user_id.label("user_id")).where(
                _starts_with(table.user_id, prefix) if prefix else true(),
                table.user_id > after if after is not None else true(),
            )
            for table in (SessionRow, ResponseRow)
        )
    ).subquery()
    query = select(ids.c.user_id).order_by(ids.c.user_id).limit(limit + 1)
    with transaction(sf) as db:
        rows = [UserId(u) for u in db.scalars(query)]
    return rows[:limit], len(rows) > limit


def holds_users_under(sf: sessionmaker[Session], prefix: str) -> bool:
    """Whether any session or stored response belongs to a user whose id starts with `prefix`."""
    with transaction(sf) as db:
        for table in (SessionRow, ResponseRow):
            query = select(table.user_id).where(_starts_with(table.user_id, prefix)).limit(1)
            if db.scalar(query) is not None:
                return True
    return False


def every_stored_user_in(db: Session) -> set[UserId]:
    """Every user with a session or a stored response, in the caller's transaction (the
    tenant-derivation upgrade rekeys their erasure epochs)."""
    return {
        UserId(u) for table in (SessionRow, ResponseRow) for u in db.scalars(select(table.user_id).distinct())
    }


OwnersAmong = Callable[[list[UserId]], list[UserId]]
"""Which of these users are the one being looked for (`Identity.users_having`, for a tenant)."""


def rows_created_by(
    db: Session, user_subject: str | None, cutoff: datetime, owners_among: OwnersAmong
) -> dict[str, int]:
    """How many sessions and stored responses (`{"session": n, "stored response": n}`) of one
    user were created by `cutoff`: an erasure's verification. Found by the user's subject hash
    (`user_subject`, which every row written since migration 0013 carries: an indexed lookup);
    rows without one (older) by their owners' ids, of which `owners_among` picks the user's
    (every row's owner, when the receipt names no subject)."""
    found = {}
    for what, table in (("session", SessionRow), ("stored response", ResponseRow)):
        before = table.created_at <= cutoff
        n = 0
        if user_subject is not None:
            n += db.execute(
                select(func.count()).select_from(table).where(table.subject == user_subject, before)
            ).scalar_one()
        # The rows the lookup above cannot find: those without a subject (all, without one).
        unmarked = [] if user_subject is None else [table.subject.is_(None)]
        users = [UserId(u) for u in db.execute(select(table.user_id).where(*unmarked).distinct()).scalars()]
        mine = owners_among(users) if users else []
        if mine:
            n += db.execute(
                select(func.count()).select_from(table).where(table.user_id.in_(mine), before, *unmarked)
            ).scalar_one()
        found[what] = int(n)
    return found
