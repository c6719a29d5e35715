"""Walking a session's version tree: from its parent map (number -> parent number), and over the
database (`VersionTree`).

Parents always have smaller numbers than their children, so one ascending pass over a parent map
finds a subtree, and an ancestor walk ends at a root (parent None) in at most `len(parents)` steps.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import transaction
from dss.dialogue.versions.rows import owned_session, parents_of
from dss.dialogue.versions.rules import EMPTY_HEAD, check_number
from dss.errors import VersionNotFound
from dss.types import SessionId, UserId


def descendants_of(parents: Mapping[int, int | None], root: int) -> list[int]:
    """`root` and every version below it, ascending (so `root` first: children have larger numbers)."""
    inside = [root]
    seen = {root}
    for number in sorted(n for n in parents if n > root):
        if parents[number] in seen:
            inside.append(number)
            seen.add(number)
    return inside


def ancestors_of(parents: Mapping[int, int | None], start: int) -> list[int]:
    """`start` and its ancestors, newest first (parents always have smaller numbers)."""
    out: list[int] = []
    cur: int | None = start
    while cur is not None and cur != EMPTY_HEAD:
        out.append(cur)
        cur = parents[cur]
    return out


def parents_having(db: Session, user: UserId, sid: SessionId, number: int) -> dict[int, int | None]:
    """The session's version → parent map, which must hold `number` (`VersionNotFound`)."""
    check_number(number, sid)
    parents = parents_of(db, user, sid)
    if number not in parents:
        raise VersionNotFound(f"version {number} not found in session {sid!r}")
    return parents


class VersionTree:
    """Ancestors and descendants of a user's versions, in their own transaction or the caller's."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._factory = session_factory

    def ancestors(self, user: UserId, sid: SessionId, number: int) -> list[int]:
        """Version `number` and its ancestors back to the root, `number` first."""
        with transaction(self._factory) as db:
            owned_session(db, user, sid)  # a missing session is SessionNotFound here
            return self.lineage(user, sid, number, db)

    def lineage(self, user: UserId, sid: SessionId, number: int, db: Session | None = None) -> list[int]:
        """`ancestors` inside the caller's transaction (`db`): `number` first, back to the root.
        `VersionNotFound` when the user has no such version, also when the session is missing."""
        if db is None:
            with transaction(self._factory) as own:
                return self.lineage(user, sid, number, own)
        return ancestors_of(parents_having(db, user, sid, number), number)

    def subtree(self, user: UserId, sid: SessionId, number: int, db: Session | None = None) -> list[int]:
        """Version `number` and every version descending from it, by number (`number` first:
        children have larger numbers). `VersionNotFound` when the user has no such version."""
        if db is None:
            with transaction(self._factory) as own:
                return self.subtree(user, sid, number, own)
        return descendants_of(parents_having(db, user, sid, number), number)
