"""Sessions: creating, reading, listing, their KV retention hints, deleting (`SessionCatalog`).

A new session always has an empty `main` branch (head `EMPTY_HEAD`), created in the same
transaction, so no session is ever seen without one. A session id is unique per user only:
another user's session of the same id neither blocks a creation nor is visible. Listings page on
(created_at, id), a key that never changes for a session.

Deleting a session (or every session of a user) deletes its branches, versions and the stored
responses that hold them (`dss.dialogue.response_store`), children before parents (correct where
foreign-key cascades are off). KV pages are not touched here: they are content-addressed and
shared in the user's trie (`dss.ops.session_kv` frees them).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from dss.db.connect import transaction
from dss.db.models import BranchRow, ResponseRow, SessionRow, aware, utcnow
from dss.dialogue.quotas import check_session_quota
from dss.dialogue.versions.records import RetentionHint, SessionInfo, session_info
from dss.dialogue.versions.rules import (
    EMPTY_HEAD,
    MAIN_BRANCH,
    MAX_LIST_LIMIT,
    MAX_METADATA_BYTES,
    MAX_SYSTEM_PROMPT_CHARS,
    check_retention,
)
from dss.dialogue.versions.shared import VersionTables, branch_rows, delete_sessions, owned_session
from dss.errors import InvalidInput, LimitExceeded, SessionExists, SessionNotFound
from dss.inputs import check_session_id, check_stored_user_id
from dss.jsonlimits import check_json
from dss.types import SessionId, UserId


class SessionCatalog(VersionTables):
    """Every user's sessions: create, get, list, set their metadata and retention hints, delete
    them (with their branches, versions and stored responses)."""

    def create_session(
        self,
        user: UserId,
        session_id: SessionId | None = None,
        system_prompt: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        *,
        epoch: int | None = None,
    ) -> SessionInfo:
        """A new session of `user` with an empty `main` branch; `SessionExists` when the user
        already has a session of that id (another user's sessions do not matter). `epoch`: the
        erasure epoch the request was admitted under (`UserErased` when the user was erased
        since; see `VersionTables.hold_user`)."""
        check_stored_user_id(user)  # a user made before ids lost '/' keeps creating sessions
        sid = (
            check_session_id(session_id) if session_id is not None else SessionId(f"sess_{uuid.uuid4().hex}")
        )
        if system_prompt is not None and len(system_prompt) > MAX_SYSTEM_PROMPT_CHARS:
            raise LimitExceeded(f"system prompt longer than {MAX_SYSTEM_PROMPT_CHARS} characters")
        meta = self._checked_metadata(metadata)
        try:
            with transaction(self._factory) as db:
                check_session_quota(db, user, self._quotas)
                # Before the first write (the reads before it lock nothing), and the time after it:
                # a racing erasure's `erased_at` is earlier, or it deletes this row.
                self.hold_user(db, user, epoch)
                now = utcnow()
                row = SessionRow(
                    id=sid,
                    user_id=user,
                    subject=self.subject_of(user),
                    created_at=now,
                    updated_at=now,
                    system_prompt=system_prompt,
                    meta=meta,
                    version_count=0,
                )
                db.add(row)
                db.flush()
                main = BranchRow(
                    user_id=user, session_id=sid, name=MAIN_BRANCH, head_version=EMPTY_HEAD, created_at=now
                )
                db.add(main)
                db.flush()
                return session_info(row, [main], self._json_limits)
        except IntegrityError as exc:
            raise SessionExists(f"session id {sid!r} is already in use") from exc

    def get_session(self, user: UserId, sid: SessionId) -> SessionInfo:
        with transaction(self._factory) as db:
            row = owned_session(db, user, sid)
            return session_info(row, branch_rows(db, user, sid), self._json_limits)

    def ensure_session(
        self,
        user: UserId,
        sid: SessionId,
        system_prompt: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        *,
        epoch: int | None = None,
    ) -> tuple[SessionInfo, bool]:
        """Get the user's session `sid`, creating it if missing; `created` says which happened.
        `epoch`: as for `create_session`."""
        try:
            return self.get_session(user, sid), False
        except SessionNotFound:
            pass
        try:
            created = self.create_session(
                user, sid, system_prompt=system_prompt, metadata=metadata, epoch=epoch
            )
            return created, True
        except SessionExists:
            # Lost a creation race with another request of the same user.
            return self.get_session(user, sid), False

    def list_sessions(
        self, user: UserId, limit: int = 20, after: SessionId | None = None
    ) -> tuple[list[SessionInfo], bool]:
        """The user's sessions ordered by (created_at, id), `limit` at a time after session `after`."""
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise InvalidInput(f"limit must be in [1, {MAX_LIST_LIMIT}]")
        with transaction(self._factory) as db:
            q = select(SessionRow).where(SessionRow.user_id == user)
            if after is not None:
                cursor = db.execute(
                    select(SessionRow.created_at, SessionRow.id).where(
                        SessionRow.user_id == user, SessionRow.id == after
                    )
                ).one_or_none()
                if cursor is None:
                    raise InvalidInput(f"unknown cursor session {after!r}")
                q = q.where(tuple_(SessionRow.created_at, SessionRow.id) > tuple_(cursor[0], cursor[1]))
            rows = list(db.scalars(q.order_by(SessionRow.created_at, SessionRow.id).limit(limit + 1)))
            has_more = len(rows) > limit
            rows = rows[:limit]
            by_session: dict[str, list[BranchRow]] = {r.id: [] for r in rows}
            if rows:
                for b in db.scalars(
                    select(BranchRow)
                    .where(BranchRow.user_id == user, BranchRow.session_id.in_(list(by_session)))
                    .order_by(BranchRow.created_at, BranchRow.name)
                ):
                    by_session[b.session_id].append(b)
            return [session_info(r, by_session[r.id], self._json_limits) for r in rows], has_more

    def set_retention(
        self, user: UserId, sid: SessionId, kv_retention: str, kv_idle_ttl_s: int | None
    ) -> SessionInfo:
        """Set the session's KV retention hint and idle TTL (None: none). `InvalidInput` for a hint
        outside KV_RETENTIONS or a TTL outside [MIN_IDLE_TTL_S, MAX_IDLE_TTL_S]."""
        check_retention(kv_retention, kv_idle_ttl_s)
        with transaction(self._factory) as db:
            row = owned_session(db, user, sid)
            row.kv_retention = kv_retention
            row.kv_idle_ttl_s = kv_idle_ttl_s
            db.flush()
            return session_info(row, branch_rows(db, user, sid), self._json_limits)

    def _checked_metadata(self, metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """A copy of the metadata to store, refused (`LimitExceeded`) over its size limit."""
        meta = dict(metadata) if metadata is not None else None
        if meta is not None and check_json("metadata", meta, self._json_limits) > MAX_METADATA_BYTES:
            raise LimitExceeded(f"metadata over {MAX_METADATA_BYTES} bytes of JSON", field="metadata")
        return meta

    def set_metadata(
        self,
        user: UserId,
        sid: SessionId,
        metadata: Mapping[str, Any] | None,
        *,
        epoch: int | None = None,
    ) -> SessionInfo:
        """Replace the session's metadata (None: none), under the limits `create_session` applies.
        `epoch`: as for `create_session`."""
        meta = self._checked_metadata(metadata)
        with transaction(self._factory) as db:
            self.hold_user(db, user, epoch)
            row = owned_session(db, user, sid)
            row.meta = meta
            row.updated_at = utcnow()
            db.flush()
            return session_info(row, branch_rows(db, user, sid), self._json_limits)

    def retention_hints(
        self, *, updated_after: datetime | None = None, hinted_only: bool = False, limit: int = MAX_LIST_LIMIT
    ) -> list[RetentionHint]:
        """Sessions of every user (for the retention sweeper, never for a user's request): those
        updated after `updated_after`, and/or (`hinted_only`) those whose hint is not the default
        (not `normal`, or an idle TTL); oldest update first, at most `limit`."""
        q = select(
            SessionRow.user_id, SessionRow.id, SessionRow.kv_retention, SessionRow.kv_idle_ttl_s,
            SessionRow.updated_at,
        )  # fmt: skip
        if updated_after is not None:
            q = q.where(SessionRow.updated_at > updated_after)
        if hinted_only:
            q = q.where((SessionRow.kv_retention != "normal") | SessionRow.kv_idle_ttl_s.is_not(None))
        q = q.order_by(SessionRow.updated_at, SessionRow.user_id, SessionRow.id).limit(limit)
        with transaction(self._factory) as db:
            return [
                RetentionHint(UserId(u), SessionId(sid), r, ttl, aware(ts))
                for u, sid, r, ttl, ts in db.execute(q).tuples()
            ]

    def delete_session(self, user: UserId, sid: SessionId, *, epoch: int | None = None) -> int:
        """Delete the session with its branches, versions and stored responses; return the number
        of versions deleted. `epoch`: the erasure epoch the request was admitted under (`UserErased`
        when the user was erased since; see `VersionTables.hold_user`)."""
        with transaction(self._factory) as db:
            self.hold_user(db, user, epoch)
            owned_session(db, user, sid)
            return delete_sessions(db, user, sid)["versions"]

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
