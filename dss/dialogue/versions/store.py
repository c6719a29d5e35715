"""Versioned sessions: the durable dialogue state, with git-like branches.

A session owns numbered versions (1, 2, 3, ... per session) that form a tree through `parent`,
and named branches whose `head_version` points into that tree (0 = the branch has no versions).
A commit appends a child of a branch head; a rollback moves a head back to one of its ancestors
(later versions stay stored); a branch is a new name pointing at any existing version.

Concurrency is optimistic and works the same on SQLite and PostgreSQL: a commit allocates its
number with a compare-and-set on `sessions.version_count` and moves the head with a
compare-and-set on `branches.head_version`. A caller that passes `expected_head` gets `StaleHead`
when another writer moved the head first; without it the commit retries on the new head.

Every method takes the acting user and sees only that user's sessions: another user's session
raises `SessionNotFound`, exactly like a missing one.

Versions are never renumbered: `delete_subtree` removes a version with all its descendants (the
Responses API's cascading DELETE), which leaves gaps below `version_count`; new commits still take
`version_count + 1`, so a deleted number never names another version later. This store owns every
row keyed by a session, the stored responses (`dss.dialogue.response_store`) included: deleting a
session, a user's sessions or a version subtree deletes the responses that hold those versions.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any, Literal, Protocol, cast, overload

import numpy as np
from sqlalchemy import (
    CursorResult,
    Delete,
    Select,
    Update,
    and_,
    bindparam,
    delete,
    select,
    tuple_,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased, sessionmaker

from dss.config import Quotas
from dss.db.connect import transaction
from dss.db.models import BranchRow, ResponseRow, SessionRow, VersionRow, utcnow
from dss.dialogue.history import prefix_digests, rebuild, stored_form
from dss.dialogue.quotas import check_commit_quota, check_session_quota
from dss.dialogue.versions.check import version_store_problems
from dss.dialogue.versions.records import (
    SUMMARY_COLS,
    BranchInfo,
    RetentionHint,
    SessionInfo,
    VersionInfo,
    VersionSummary,
    VersionTokens,
    aware,
    branch_info,
    full_version,
    session_info,
    version_summary,
)
from dss.dialogue.versions.rules import (
    EMPTY_HEAD,
    EMPTY_TOKENS,
    INT32_MAX,
    MAIN_BRANCH,
    MAX_LIST_LIMIT,
    MAX_METADATA_BYTES,
    MAX_SYSTEM_PROMPT_CHARS,
    check_name,
    check_number,
    check_retention,
    coerce_tokens,
    json_size,
    normalised,
)
from dss.dialogue.versions.tree import ancestors_of, descendants_of
from dss.errors import (
    BranchExists,
    BranchNotFound,
    InvalidInput,
    LimitExceeded,
    NotAnAncestor,
    SessionExists,
    SessionNotFound,
    StaleHead,
    VersionNotFound,
)
from dss.inputs import check_session_id, check_stored_user_id
from dss.jsonlimits import JsonLimits, check_items, check_json
from dss.tokens import TOKEN_DTYPE
from dss.types import FingerprintId, SessionId, UserId

log = logging.getLogger("dss.versions")

# Each retry means another writer committed in between; far more than that is a livelock.
MAX_COMMIT_ATTEMPTS = 64
# Bound parameters per IN (...) list; SQLite allows 32766 in all, PostgreSQL 65535.
_IN_CHUNK = 500
# Versions whose token ids `iter_tokens` reads per query: what it holds at once is this many
# versions' ids (8 x 64 KiB at 16k tokens), whatever the length of the history it walks.
_TOKEN_CHUNK = 8


class WriteFence(Protocol):
    """Orders the writes of a user's rows against erasures of that user (`Identity.fence_in`):
    called before the first write of every transaction that writes or deletes rows of `user`;
    raises `UserErased` when `admitted` (the erasure epoch the request was admitted under; None:
    any) is no longer the user's. Returns the user's epoch."""

    def fence_in(self, session: Session, user: UserId, admitted: int | None) -> int: ...


class _LostRace(StaleHead):
    """A compare-and-set missed: another writer got in between. Caught and retried internally;
    a StaleHead so that even an escape would carry the right meaning."""


class VersionStore:
    """Sessions, branches and versions of every user, over a SQLAlchemy session factory.

    Every row is keyed by its owner first: `(user_id, session_id, ...)`. A query never names a
    session without its user, so one user's ids say nothing about another's.
    """

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        quotas: Quotas | None = None,
        json_limits: JsonLimits | None = None,
        fence: WriteFence | None = None,
    ) -> None:
        self._factory = session_factory
        self._quotas = quotas if quotas is not None else Quotas()
        self._json_limits = json_limits if json_limits is not None else JsonLimits()
        self._fence = fence

    def hold_user(self, db: Session, user: UserId, epoch: int | None = None) -> None:
        """The write fence (`WriteFence`), before the first write (or row lock) of a transaction
        that writes rows of `user`: an erasure of the user then runs entirely before or entirely
        after the writes, and `UserErased` when `epoch` (the one the request was admitted under;
        None: any) is not the user's any more. Without a fence (a bare `VersionStore`), nothing."""
        if self._fence is not None:
            self._fence.fence_in(db, user, epoch)

    # --- sessions ------------------------------------------------------------------------------
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
        since; see `hold_user`)."""
        check_stored_user_id(user)  # a user made before ids lost '/' keeps creating sessions
        sid = (
            check_session_id(session_id) if session_id is not None else SessionId(f"sess_{uuid.uuid4().hex}")
        )
        if system_prompt is not None and len(system_prompt) > MAX_SYSTEM_PROMPT_CHARS:
            raise LimitExceeded(f"system prompt longer than {MAX_SYSTEM_PROMPT_CHARS} characters")
        meta = dict(metadata) if metadata is not None else None
        if meta is not None and check_json("metadata", meta, self._json_limits) > MAX_METADATA_BYTES:
            raise LimitExceeded(f"metadata over {MAX_METADATA_BYTES} bytes of JSON", field="metadata")
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
            row = self._owned(db, user, sid)
            return session_info(row, self._branch_rows(db, user, sid), self._json_limits)

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
            row = self._owned(db, user, sid)
            row.kv_retention = kv_retention
            row.kv_idle_ttl_s = kv_idle_ttl_s
            db.flush()
            return session_info(row, self._branch_rows(db, user, sid), self._json_limits)

    def set_metadata(self, user: UserId, sid: SessionId, metadata: Mapping[str, Any] | None) -> SessionInfo:
        """Replace the session's metadata (None: none), under the limits `create_session` applies."""
        meta = dict(metadata) if metadata is not None else None
        if meta is not None and check_json("metadata", meta, self._json_limits) > MAX_METADATA_BYTES:
            raise LimitExceeded(f"metadata over {MAX_METADATA_BYTES} bytes of JSON", field="metadata")
        with transaction(self._factory) as db:
            self.hold_user(db, user)
            row = self._owned(db, user, sid)
            row.meta = meta
            row.updated_at = utcnow()
            db.flush()
            return session_info(row, self._branch_rows(db, user, sid), self._json_limits)

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

    def version_tokens(self, user: UserId, sid: SessionId, numbers: Iterable[int]) -> dict[int, np.ndarray]:
        """The token ids of these versions of the session (for the retention sweeper: no messages
        are read or rebuilt); numbers it does not have are left out."""
        want = sorted(set(numbers))
        out: dict[int, np.ndarray] = {}
        with transaction(self._factory) as db:
            self._owned(db, user, sid)
            for i in range(0, len(want), 500):
                q = select(VersionRow.number, VersionRow.tokens).where(
                    *_version_key(user, sid), VersionRow.number.in_(want[i : i + 500])
                )
                for number, raw in db.execute(q).tuples():
                    out[number] = np.frombuffer(raw, dtype=TOKEN_DTYPE) if raw else EMPTY_TOKENS
        return out

    def iter_tokens(
        self,
        user: UserId,
        sid: SessionId | None = None,
        *,
        fingerprints: Iterable[str] | None = None,
        after: int = 0,
        through: int | None = None,
    ) -> Iterator[VersionTokens]:
        """The token ids of the user's versions that have tokens, by (session, number): those of
        session `sid` only when given (numbers in (`after`, `through`]), only those of these
        model `fingerprints` when given. No message is read.

        Read `_TOKEN_CHUNK` versions per query (keyset on (session, number)), so a walk over a
        whole history holds one chunk, not the history. One read transaction serves the walk
        until it ends or the iterator is dropped. `SessionNotFound` at the call (not at the
        first item) when `sid` is not the user's.
        """
        only = sorted(set(fingerprints)) if fingerprints is not None else None
        where: list[Any] = [VersionRow.user_id == user, VersionRow.n_tokens > 0]
        if sid is not None:
            where.append(VersionRow.session_id == sid)
            if through is not None:
                where.append(VersionRow.number <= min(through, INT32_MAX))
        if only is not None:
            where.append(VersionRow.fingerprint.in_(only))
        # One statement for every chunk, the cursor bound: session ids are never empty, so the
        # first cursor ("", -1) is below every row of a walk over all sessions.
        cursor = tuple_(VersionRow.session_id, VersionRow.number) > tuple_(bindparam("sid"), bindparam("n"))
        q = (
            select(VersionRow.session_id, VersionRow.number, VersionRow.fingerprint, VersionRow.tokens)
            .where(*where, cursor)
            .order_by(VersionRow.session_id, VersionRow.number)
            .limit(_TOKEN_CHUNK)
        )
        # Numbers are INTEGER columns: a larger bound names no version (and PostgreSQL refuses it).
        start = (sid, min(after, INT32_MAX)) if sid is not None else ("", -1)
        walk = self._token_chunks(user, sid, q if only is None or only else None, start)
        next(walk)  # opens the transaction and checks the session: SessionNotFound here, at the call
        return (v for v in walk if v is not None)

    def _token_chunks(
        self, user: UserId, sid: SessionId | None, q: Select[Any] | None, last: tuple[str, int]
    ) -> Iterator[VersionTokens | None]:
        """None first (once the session is checked), then the versions. A walk dropped before its
        end is closed by the garbage collector, which ends its transaction."""
        with transaction(self._factory) as db:
            if sid is not None:
                self._owned(db, user, sid)
            yield None
            while q is not None:
                chunk = db.execute(q, {"sid": last[0], "n": last[1]}).all()
                for r in chunk:
                    yield VersionTokens(
                        session_id=SessionId(r.session_id),
                        number=r.number,
                        fingerprint=FingerprintId(r.fingerprint) if r.fingerprint else None,
                        tokens=np.frombuffer(r.tokens, dtype=TOKEN_DTYPE),
                    )
                if len(chunk) < _TOKEN_CHUNK:
                    return
                last = (chunk[-1].session_id, chunk[-1].number)
                del chunk, r  # this chunk's bodies go before the next one is read

    def delete_session(self, user: UserId, sid: SessionId) -> int:
        """Delete the session with its branches, versions and stored responses; return the number
        of versions deleted."""
        with transaction(self._factory) as db:
            self.hold_user(db, user)
            self._owned(db, user, sid)
            return self._delete_where(db, user, sid)["versions"]

    # --- commits, rollbacks, branches ----------------------------------------------------------
    def commit(
        self,
        user: UserId,
        sid: SessionId,
        *,
        tokens: Sequence[int] | np.ndarray,
        messages: Sequence[Mapping[str, Any]],
        branch: str = MAIN_BRANCH,
        parent: int | None = None,
        expected_head: int | None = None,
        fingerprint: str | None = None,
        epoch: int | None = None,
    ) -> VersionInfo:
        """Append a version as the child of `branch`'s head and move the head to it.

        `parent` and `expected_head` both pin the head the caller built on (0 = empty branch):
        when the head is elsewhere, `StaleHead`. Without either, the commit goes on top of
        whatever the head is when it lands. `epoch`: the erasure epoch the turn was admitted
        under (`UserErased` when the user was erased since; see `hold_user`).
        """
        arr = coerce_tokens(tokens)
        check_items("messages", messages, self._json_limits)  # before anything walks them recursively
        msgs = normalised(messages)
        if fingerprint is not None and len(fingerprint) > 64:
            raise InvalidInput("fingerprint longer than 64 characters")
        pinned = {h for h in (parent, expected_head) if h is not None}
        if len(pinned) > 1:
            raise InvalidInput(f"parent {parent} and expected_head {expected_head} disagree")
        want = pinned.pop() if pinned else None
        body = arr.tobytes()
        for _ in range(MAX_COMMIT_ATTEMPTS):
            try:
                return self._try_commit(
                    user, sid, branch, want, body, int(arr.size), msgs, fingerprint, epoch
                )
            except _LostRace:
                continue
        raise StaleHead(f"commit on {sid!r}/{branch!r} lost {MAX_COMMIT_ATTEMPTS} races in a row")

    def _try_commit(
        self,
        user: UserId,
        sid: SessionId,
        branch: str,
        want: int | None,
        body: bytes,
        n_tokens: int,
        msgs: list[dict[str, Any]],
        fingerprint: str | None,
        epoch: int | None,
    ) -> VersionInfo:
        with transaction(self._factory) as db:
            try:
                count = self._owned(db, user, sid).version_count
            except SessionNotFound:
                self.hold_user(db, user, epoch)  # `UserErased` when an erasure deleted it
                raise
            head = self._branch_row(db, user, sid, branch).head_version
            if want is not None and head != want:
                raise StaleHead(f"branch {branch!r} head is {head}, expected {want}")
            base = None
            if head != EMPTY_HEAD:
                row = db.execute(
                    select(VersionRow.n_messages, VersionRow.digest).where(
                        *_version_key(user, sid), VersionRow.number == head
                    )
                ).one_or_none()
                if row is None:  # deleted (a cascade) after we read the head: re-read everything
                    raise _LostRace
                base = (row[0], row[1])
            stored = stored_form(msgs, *(base if base is not None else (None, None)))
            delta_bytes = json_size("messages", stored.delta)
            check_commit_quota(db, user, self._quotas, len(body) + delta_bytes)
            # The fence before the first write (on SQLite it takes the write lock, so the quota's
            # sum above did not hold it); what was read before is checked by the compare-and-sets.
            self.hold_user(db, user, epoch)
            number = count + 1
            now = utcnow()
            # Both compare-and-sets must hold for the commit to stand; a miss means another writer
            # got in between, and the transaction is rolled back and everything re-read.
            took_number = _rowcount(
                db,
                update(SessionRow)
                .where(SessionRow.user_id == user, SessionRow.id == sid, SessionRow.version_count == count)
                .values(version_count=number, updated_at=now),
            )
            if took_number != 1:
                raise _LostRace
            self._move_head(db, user, sid, branch, head, number)
            parent = head if head != EMPTY_HEAD else None
            added = VersionRow(
                user_id=user,
                session_id=sid,
                number=number,
                parent=parent,
                branch=branch,
                created_at=now,
                n_tokens=n_tokens,
                tokens=body,
                messages=stored.delta,
                messages_base=stored.base,
                n_messages=stored.n_messages,
                digest=stored.digest,
                body_bytes=len(body) + delta_bytes,
                fingerprint=fingerprint,
            )
            db.add(added)
            db.flush()
        return full_version(added, msgs)

    def rollback(
        self,
        user: UserId,
        sid: SessionId,
        branch: str,
        to_version: int,
        expected_head: int | None = None,
        *,
        epoch: int | None = None,
    ) -> BranchInfo:
        """Move `branch`'s head back to `to_version`, an ancestor-or-self of the current head.

        Versions after it stay stored and listed (another branch may still point at them).
        `epoch`: as for `commit`.
        """
        for _ in range(MAX_COMMIT_ATTEMPTS):
            try:
                with transaction(self._factory) as db:
                    self.hold_user(db, user, epoch)
                    self._owned(db, user, sid)
                    brow = self._branch_row(db, user, sid, branch)
                    head = brow.head_version
                    if expected_head is not None and head != expected_head:
                        raise StaleHead(f"branch {branch!r} head is {head}, expected {expected_head}")
                    parents = self._parents(db, user, sid)
                    if to_version not in parents:
                        raise VersionNotFound(f"version {to_version} not found in session {sid!r}")
                    if to_version not in ancestors_of(parents, head):
                        raise NotAnAncestor(
                            f"version {to_version} is not on the history of branch {branch!r}"
                        )
                    self._move_head(db, user, sid, branch, head, to_version)
                    self._touch(db, user, sid)
                    return replace(branch_info(brow), head_version=to_version)
            except _LostRace:
                if expected_head is not None:
                    raise StaleHead(f"branch {branch!r} head moved during the rollback") from None
        raise StaleHead(f"rollback of {sid!r}/{branch!r} lost {MAX_COMMIT_ATTEMPTS} races in a row")

    def branch(
        self, user: UserId, sid: SessionId, from_version: int, name: str, *, epoch: int | None = None
    ) -> BranchInfo:
        """A new branch `name` whose head is the existing version `from_version`
        (`EMPTY_HEAD`, 0: a branch with no versions yet, for a fork of a session's first turn).
        `epoch`: as for `commit`."""
        check_name("branch name", name)
        check_number(from_version, sid)
        try:
            with transaction(self._factory) as db:
                self.hold_user(db, user, epoch)
                self._owned(db, user, sid)
                if from_version != EMPTY_HEAD:
                    exists = db.scalar(
                        select(VersionRow.number).where(
                            *_version_key(user, sid), VersionRow.number == from_version
                        )
                    )
                    if exists is None:
                        raise VersionNotFound(f"version {from_version} not found in session {sid!r}")
                if self._branch_row(db, user, sid, name, missing_ok=True) is not None:
                    raise BranchExists(f"branch {name!r} already exists")
                row = BranchRow(
                    user_id=user, session_id=sid, name=name, head_version=from_version, created_at=utcnow()
                )
                db.add(row)
                db.flush()
                self._touch(db, user, sid)
                return branch_info(row)
        except IntegrityError as exc:
            # A concurrent writer created the same name (or deleted the session) in between.
            self.get_session(user, sid)
            raise BranchExists(f"branch {name!r} already exists") from exc

    # --- reads ---------------------------------------------------------------------------------
    def list_branches(self, user: UserId, sid: SessionId) -> list[BranchInfo]:
        with transaction(self._factory) as db:
            self._owned(db, user, sid)
            return [branch_info(b) for b in self._branch_rows(db, user, sid)]

    def get_branch(self, user: UserId, sid: SessionId, name: str) -> BranchInfo:
        with transaction(self._factory) as db:
            self._owned(db, user, sid)
            return branch_info(self._branch_row(db, user, sid, name))

    @overload
    def list_versions(
        self, user: UserId, sid: SessionId, with_body: Literal[False] = False
    ) -> list[VersionSummary]: ...
    @overload
    def list_versions(self, user: UserId, sid: SessionId, with_body: Literal[True]) -> list[VersionInfo]: ...
    def list_versions(
        self, user: UserId, sid: SessionId, with_body: bool = False
    ) -> list[VersionSummary] | list[VersionInfo]:
        """Every version of the session by number, including ones no branch points at any more."""
        with transaction(self._factory) as db:
            self._owned(db, user, sid)
            if with_body:
                q = select(VersionRow).where(*_version_key(user, sid)).order_by(VersionRow.number)
                full: dict[int, list[dict[str, Any]]] = {}
                out: list[VersionInfo] = []
                for r in db.scalars(q):  # parents have smaller numbers: rebuilt before children
                    # A version that inherits messages has a parent (messages_base > 0 only then).
                    inherited = full[r.parent][: r.messages_base] if r.messages_base and r.parent else []
                    full[r.number] = inherited + list(r.messages)
                    out.append(full_version(r, full[r.number]))
                return out
            q2 = select(*SUMMARY_COLS).where(*_version_key(user, sid)).order_by(VersionRow.number)
            return [version_summary(r) for r in db.execute(q2)]

    def version_page(
        self, user: UserId, sid: SessionId, limit: int = 20, after: int = 0
    ) -> tuple[list[VersionSummary], bool]:
        """The session's versions by number, `limit` at a time after number `after` (a cursor that
        names a deleted version, or none, still works: numbers only grow); whether more follow."""
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise InvalidInput(f"limit must be in [1, {MAX_LIST_LIMIT}]")
        with transaction(self._factory) as db:
            self._owned(db, user, sid)
            q = (
                select(*SUMMARY_COLS)
                .where(*_version_key(user, sid), VersionRow.number > min(after, INT32_MAX))
                .order_by(VersionRow.number)
                .limit(limit + 1)
            )
            rows = [version_summary(r) for r in db.execute(q)]
        return rows[:limit], len(rows) > limit

    @overload
    def get_version(
        self, user: UserId, sid: SessionId, number: int, with_body: Literal[True] = True
    ) -> VersionInfo: ...
    @overload
    def get_version(
        self, user: UserId, sid: SessionId, number: int, with_body: Literal[False]
    ) -> VersionSummary: ...
    def get_version(
        self, user: UserId, sid: SessionId, number: int, with_body: bool = True
    ) -> VersionSummary:
        check_number(number, sid)
        with transaction(self._factory) as db:
            self._owned(db, user, sid)
            if with_body:
                return self._full_version(db, user, sid, number)
            where = (*_version_key(user, sid), VersionRow.number == number)
            r = db.execute(select(*SUMMARY_COLS).where(*where)).one_or_none()
            if r is None:
                raise VersionNotFound(f"version {number} not found in session {sid!r}")
            return version_summary(r)

    def ancestors(self, user: UserId, sid: SessionId, number: int) -> list[int]:
        """Version `number` and its ancestors back to the root, `number` first."""
        with transaction(self._factory) as db:
            self._owned(db, user, sid)
            parents = self._parents(db, user, sid)
            if number not in parents:
                raise VersionNotFound(f"version {number} not found in session {sid!r}")
            return ancestors_of(parents, number)

    def lineage(self, user: UserId, sid: SessionId, number: int, db: Session | None = None) -> list[int]:
        """`ancestors` inside the caller's transaction (`db`): `number` first, back to the root.
        `VersionNotFound` when the user has no such version, also when the session is missing."""
        if db is None:
            with transaction(self._factory) as own:
                return self.lineage(user, sid, number, own)
        return ancestors_of(self._parents_having(db, user, sid, number), number)

    def subtree(self, user: UserId, sid: SessionId, number: int, db: Session | None = None) -> list[int]:
        """Version `number` and every version descending from it, by number (`number` first:
        children have larger numbers). `VersionNotFound` when the user has no such version."""
        if db is None:
            with transaction(self._factory) as own:
                return self.subtree(user, sid, number, own)
        return descendants_of(self._parents_having(db, user, sid, number), number)

    def _parents_having(
        self, db: Session, user: UserId, sid: SessionId, number: int
    ) -> dict[int, int | None]:
        """The session's version → parent map, which must hold `number` (`VersionNotFound`)."""
        check_number(number, sid)
        parents = self._parents(db, user, sid)
        if number not in parents:
            raise VersionNotFound(f"version {number} not found in session {sid!r}")
        return parents

    def hold_session(self, user: UserId, sid: SessionId, db: Session) -> None:
        """Take the session's write lock in the caller's transaction, so that what it reads next
        stays true until it commits: an UPDATE of the session row (its `updated_at`), which on
        PostgreSQL locks the row that every commit also updates, and on SQLite takes the database
        write lock. `SessionNotFound` when the user has no such session."""
        moved = _rowcount(
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
        check_number(number, sid)
        self.hold_user(db, user)
        self.hold_session(user, sid, db)
        parents = self._parents(db, user, sid)
        if number not in parents:
            raise VersionNotFound(f"version {number} not found in session {sid!r}")
        doomed = descendants_of(parents, number)
        parent = parents[number]
        new_head = parent if parent is not None else EMPTY_HEAD
        for i in range(0, len(doomed), _IN_CHUNK):
            chunk = doomed[i : i + _IN_CHUNK]
            _rowcount(
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
            _rowcount(
                db,
                delete(ResponseRow).where(
                    ResponseRow.user_id == user,
                    ResponseRow.session_id == sid,
                    ResponseRow.version.in_(chunk),
                ),
            )
            _rowcount(db, delete(VersionRow).where(*_version_key(user, sid), VersionRow.number.in_(chunk)))
        return doomed

    def find_deepest_prefix_version(
        self,
        user: UserId,
        sid: SessionId,
        messages: Sequence[Mapping[str, Any]],
        *,
        holding_tokens: bool = False,
    ) -> VersionInfo | None:
        """The version with the most messages whose messages are a prefix of (or equal to) `messages`.

        Among equally deep matches, a version that is some branch's head wins, then the lowest
        number. Returns None when no version matches (a new turn then starts from scratch).
        `holding_tokens`: only versions that store token ids (a turn can continue from those; a
        version of messages only, such as a conversation's added items, has none).
        One indexed lookup of the prefix digests; no version's messages are read but the answer's.
        """
        want = prefix_digests(normalised(messages))
        with transaction(self._factory) as db:
            self._owned(db, user, sid)
            candidates: list[tuple[int, int]] = []
            for chunk_start in range(0, len(want), _IN_CHUNK):
                chunk = want[chunk_start : chunk_start + _IN_CHUNK]
                q = select(VersionRow.number, VersionRow.n_messages, VersionRow.digest).where(
                    *_version_key(user, sid), VersionRow.digest.in_(chunk)
                )
                if holding_tokens:
                    q = q.where(VersionRow.n_tokens > 0)
                for number, depth, digest in db.execute(q).tuples():
                    # The digest covers the whole stored list, so it must be that prefix's.
                    if depth < len(want) and want[depth] == digest:
                        candidates.append((number, depth))
            if not candidates:
                return None
            heads = set(
                db.scalars(
                    select(BranchRow.head_version).where(
                        BranchRow.user_id == user, BranchRow.session_id == sid
                    )
                )
            )
            best = min(candidates, key=lambda c: (-c[1], c[0] not in heads, c[0]))
            return self._full_version(db, user, sid, best[0])

    # --- erasure -------------------------------------------------------------------------------
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
            return self._delete_where(db, user)
        with transaction(self._factory) as own:
            return self._delete_where(own, user)

    # --- invariants ----------------------------------------------------------------------------
    def check(self) -> list[str]:
        """Every broken invariant of the version store, as readable lines (empty = healthy)."""
        with transaction(self._factory) as db:
            return version_store_problems(db)

    # --- internals -----------------------------------------------------------------------------
    @staticmethod
    def _owned(db: Session, user: UserId, sid: SessionId) -> SessionRow:
        row = db.scalar(select(SessionRow).where(SessionRow.user_id == user, SessionRow.id == sid))
        if row is None:
            raise SessionNotFound(f"session {sid!r} not found")
        return row

    @staticmethod
    def _full_version(db: Session, user: UserId, sid: SessionId, number: int) -> VersionInfo:
        """Version `number` with its whole message list, rebuilt from its chain of stored deltas
        in one recursive query (it stops at the first ancestor that stores a whole list)."""
        row = db.scalar(select(VersionRow).where(*_version_key(user, sid), VersionRow.number == number))
        if row is None:
            raise VersionNotFound(f"version {number} not found in session {sid!r}")
        if row.messages_base == 0:
            return full_version(row, list(row.messages))
        v = aliased(VersionRow)
        cols = (VersionRow.number, VersionRow.parent, VersionRow.messages_base, VersionRow.messages)
        chain = (
            select(*cols)
            .where(*_version_key(user, sid), VersionRow.number == row.parent)
            .cte("chain", recursive=True)
        )
        chain = chain.union_all(
            select(v.number, v.parent, v.messages_base, v.messages)
            .join(chain, and_(v.number == chain.c.parent, chain.c.messages_base > 0))
            .where(v.user_id == user, v.session_id == sid)
        )
        rows = db.execute(select(chain.c.messages_base, chain.c.messages).order_by(chain.c.number)).tuples()
        return full_version(row, rebuild([*rows, (row.messages_base, row.messages)]))

    @staticmethod
    def _branch_rows(db: Session, user: UserId, sid: SessionId) -> list[BranchRow]:
        q = (
            select(BranchRow)
            .where(BranchRow.user_id == user, BranchRow.session_id == sid)
            .order_by(BranchRow.created_at, BranchRow.name)
        )
        return list(db.scalars(q))

    @overload
    @staticmethod
    def _branch_row(
        db: Session, user: UserId, sid: SessionId, name: str, missing_ok: Literal[False] = False
    ) -> BranchRow: ...
    @overload
    @staticmethod
    def _branch_row(
        db: Session, user: UserId, sid: SessionId, name: str, missing_ok: Literal[True]
    ) -> BranchRow | None: ...
    @staticmethod
    def _branch_row(
        db: Session, user: UserId, sid: SessionId, name: str, missing_ok: bool = False
    ) -> BranchRow | None:
        row = db.scalar(
            select(BranchRow).where(
                BranchRow.user_id == user, BranchRow.session_id == sid, BranchRow.name == name
            )
        )
        if row is None and not missing_ok:
            raise BranchNotFound(f"branch {name!r} not found in session {sid!r}")
        return row

    @staticmethod
    def _parents(db: Session, user: UserId, sid: SessionId) -> dict[int, int | None]:
        q = select(VersionRow.number, VersionRow.parent).where(*_version_key(user, sid))
        return {number: parent for number, parent in db.execute(q).tuples()}

    @staticmethod
    def _move_head(db: Session, user: UserId, sid: SessionId, branch: str, old: int, new: int) -> None:
        """Compare-and-set of a branch head; `_LostRace` when another writer moved it first."""
        moved = _rowcount(
            db,
            update(BranchRow)
            .where(
                BranchRow.user_id == user,
                BranchRow.session_id == sid,
                BranchRow.name == branch,
                BranchRow.head_version == old,
            )
            .values(head_version=new),
        )
        if moved != 1:
            raise _LostRace

    @staticmethod
    def _touch(db: Session, user: UserId, sid: SessionId) -> None:
        db.execute(
            update(SessionRow)
            .where(SessionRow.user_id == user, SessionRow.id == sid)
            .values(updated_at=utcnow())
            .execution_options(synchronize_session=False)
        )

    @staticmethod
    def _delete_where(db: Session, user: UserId, sid: SessionId | None = None) -> dict[str, int]:
        """Delete session `sid` of `user` (every session of the user when None).

        Children go first and explicitly, which stays correct where foreign-key cascades are off.
        """

        def scope(table: type[VersionRow] | type[BranchRow] | type[ResponseRow]) -> list[Any]:
            return [table.user_id == user] + ([table.session_id == sid] if sid is not None else [])

        responses = _rowcount(db, delete(ResponseRow).where(*scope(ResponseRow)))
        versions = _rowcount(db, delete(VersionRow).where(*scope(VersionRow)))
        branches = _rowcount(db, delete(BranchRow).where(*scope(BranchRow)))
        own = [SessionRow.user_id == user] + ([SessionRow.id == sid] if sid is not None else [])
        sessions = _rowcount(db, delete(SessionRow).where(*own))
        return {"sessions": sessions, "versions": versions, "branches": branches, "responses": responses}


def _version_key(user: UserId, sid: SessionId) -> tuple[Any, Any]:
    return (VersionRow.user_id == user, VersionRow.session_id == sid)


def _rowcount(db: Session, stmt: Update | Delete) -> int:
    """Rows matched by a bulk UPDATE/DELETE (the ORM session is not synchronised: rows are re-read)."""
    result = db.execute(stmt.execution_options(synchronize_session=False))
    return cast(CursorResult[Any], result).rowcount
