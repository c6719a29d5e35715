"""Deleting rows: a session, a version subtree, every session of a user (`Deletions`).

This store owns every row keyed by a session, the stored responses (`dss.dialogue.response_store`)
included: deleting a session, a user's sessions or a version subtree deletes the responses that
hold those versions, children before parents (correct where foreign-key cascades are off).

Versions are never renumbered: `delete_subtree` (the Responses API's cascading DELETE) leaves gaps
below `version_count`, and new commits still take `version_count + 1`, so a deleted number never
names another version later. Branch heads that pointed into a deleted subtree move to its parent;
no branch is deleted but with its session. KV pages are not touched here: they are
content-addressed and shared in the user's trie (`dss.ops.sessions` frees them).
"""

from __future__ import annotations

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import transaction
from dss.db.models import BranchRow, ResponseRow, SessionRow, VersionRow, utcnow
from dss.dialogue.versions.fence import UserFence
from dss.dialogue.versions.rows import (
    delete_sessions,
    in_chunks,
    owned_session,
    rowcount,
    version_key,
)
from dss.dialogue.versions.rules import EMPTY_HEAD, check_number
from dss.dialogue.versions.tree import descendants_of, parents_having
from dss.errors import SessionNotFound
from dss.types import SessionId, UserId


class Deletions:
    """Deletes a user's rows, under the user's write fence."""

    def __init__(self, session_factory: sessionmaker[Session], fence: UserFence) -> None:
        self._factory = session_factory
        self._fence = fence

    def delete_session(self, user: UserId, sid: SessionId, *, epoch: int | None = None) -> int:
        """Delete the session with its branches, versions and stored responses; return the number
        of versions deleted. `epoch`: the erasure epoch the request was admitted under (`UserErased`
        when the user was erased since; see `UserFence.hold_user`)."""
        with transaction(self._factory) as db:
            self._fence.hold_user(db, user, epoch)
            owned_session(db, user, sid)
            return delete_sessions(db, user, sid)["versions"]

    def hold_session(self, user: UserId, sid: SessionId, db: Session) -> None:
        """Take the session's write lock in the caller's transaction, so that what it reads next
        stays true until it commits: an UPDATE of the session row (its `updated_at`), which on
        PostgreSQL locks the row that every commit also updates, and on SQLite takes the database
        write lock. `SessionNotFound` when the user has no such session."""
        moved = rowcount(
            db,
            update(SessionRow)
            .where(SessionRow.user_id == user, SessionRow.id == sid)
            .values(updated_at=utcnow()),
        )
        if moved != 1:
            raise SessionNotFound(f"session {sid!r} not found")

    def delete_subtree(
        self, user: UserId, sid: SessionId, number: int, db: Session | None = None
    ) -> list[int]:
        """Delete version `number` and every version descending from it, with the stored responses
        that hold any of them; return the deleted numbers, ascending (`number` first).

        Branch heads that pointed into the subtree move to the parent of `number` (EMPTY_HEAD, 0,
        when it was a root); no branch is deleted, `main` included. Numbers are not reused. The
        session is held (`hold_session`) before anything is read, so a concurrent commit either
        lands first (and its version is in the subtree read here, deleted with it) or finds its
        head moved and retries on the new one. KV pages are not touched: they are content-addressed
        and shared in the user's trie. Pass `db` to run inside the caller's transaction.
        """
        if db is None:
            with transaction(self._factory) as own:
                return self.delete_subtree(user, sid, number, own)
        check_number(number, sid)  # before anything is locked or written
        self._fence.hold_user(db, user)
        self.hold_session(user, sid, db)
        parents = parents_having(db, user, sid, number)
        doomed = descendants_of(parents, number)
        parent = parents[number]
        new_head = parent if parent is not None else EMPTY_HEAD
        for chunk in in_chunks(doomed):
            rowcount(
                db,
                update(BranchRow)
                .where(
                    BranchRow.user_id == user,
                    BranchRow.session_id == sid,
                    BranchRow.head_version.in_(chunk),
                )
                .values(head_version=new_head),
            )
            # Responses first: they reference their versions (where foreign-key actions are off too).
            rowcount(
                db,
                delete(ResponseRow).where(
                    ResponseRow.user_id == user,
                    ResponseRow.session_id == sid,
                    ResponseRow.version.in_(chunk),
                ),
            )
            rowcount(db, delete(VersionRow).where(*version_key(user, sid), VersionRow.number.in_(chunk)))
        return doomed

    def holds_user(self, user: UserId) -> bool:
        """Whether `user` has a session or a stored response."""
        with self._factory() as db:
            for table in (SessionRow, ResponseRow):
                if db.scalar(select(table.user_id).where(table.user_id == user).limit(1)) is not None:
                    return True
        return False

    def delete_user_sessions(self, user: UserId, db: Session | None = None) -> dict[str, int]:
        """Delete every session of `user`; counts of deleted sessions, versions, branches and
        stored responses.

        Pass `db` to run inside the caller's transaction (erasure commits it with the rest).
        """
        if db is not None:
            return delete_sessions(db, user)
        with transaction(self._factory) as own:
            return delete_sessions(own, user)
