"""The users the dialogue state names: every user id with a session or a stored response.

A user exists in the store by what it holds (there is no table of users): sessions and stored
responses name their owner in clear; data keys and erasure epochs name only salted hashes, so
they cannot be listed. An erased user holds no session nor response, and so is not listed.

`prefix` selects the users whose id starts with it: a frontend's end users are the DSS users
`<frontend>/<end user>` (`api.keys.frontends`), listed with the prefix `<frontend>/`. The prefix
is compared as a string (`substr`), never as a `LIKE` pattern: `_` and `%` are ordinary here.
"""

from __future__ import annotations

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
