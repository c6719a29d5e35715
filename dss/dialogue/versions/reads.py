"""Reading versions (`VersionReads`): one, all, a page, the deepest one a message list extends;
their token ids without their messages; a version's ancestors and descendants.

A version's messages are stored as a delta on its parent's (`dss.dialogue.history`); every read
that returns messages rebuilds the whole list, and listings without bodies read no messages at
all. Numbers only grow, so a page cursor that names a deleted version (or none) still works.

Token ids are read without messages for the retention sweeper, for finding a deleted session's KV
(`dss.ops.session_kv`) and for the API's token listings. A walk over a whole history (`iter_tokens`)
holds one chunk of `_TOKEN_CHUNK` versions at a time, never the history: it pages with a keyset on
(session, number) inside one read transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, overload

import numpy as np
from sqlalchemy import Select, bindparam, select, tuple_
from sqlalchemy.orm import Session

from dss.db.connect import transaction
from dss.db.models import BranchRow, VersionRow
from dss.dialogue.history import prefix_digests, with_lead
from dss.dialogue.versions.records import (
    SUMMARY_COLS,
    VersionInfo,
    VersionSummary,
    VersionTokens,
    full_version,
    version_summary,
)
from dss.dialogue.versions.rules import EMPTY_TOKENS, INT32_MAX, MAX_LIST_LIMIT, check_number, normalised
from dss.dialogue.versions.shared import (
    VersionTables,
    ancestors_of,
    descendants_of,
    in_chunks,
    load_version,
    owned_session,
    parents_having,
    version_key,
)
from dss.errors import InvalidInput, VersionNotFound
from dss.tokens import TOKEN_DTYPE
from dss.types import FingerprintId, SessionId, UserId

# Versions whose token ids `iter_tokens` reads per query: what it holds at once is this many
# versions' ids (8 x 64 KiB at 16k tokens), whatever the length of the history it walks.
_TOKEN_CHUNK = 8


class VersionReads(VersionTables):
    """A user's versions: with or without their bodies, their token ids alone, their ancestors and
    descendants."""

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
            owned_session(db, user, sid)
            if with_body:
                q = select(VersionRow).where(*version_key(user, sid)).order_by(VersionRow.number)
                full: dict[int, list[dict[str, Any]]] = {}
                out: list[VersionInfo] = []
                for r in db.scalars(q):  # parents have smaller numbers: rebuilt before children
                    # A version that inherits messages has a parent (messages_base > 0 only then).
                    inherited = full[r.parent][: r.messages_base] if r.messages_base and r.parent else []
                    full[r.number] = with_lead(inherited + list(r.messages), r.lead)
                    out.append(full_version(r, full[r.number]))
                return out
            q2 = select(*SUMMARY_COLS).where(*version_key(user, sid)).order_by(VersionRow.number)
            return [version_summary(r) for r in db.execute(q2)]

    def version_page(
        self, user: UserId, sid: SessionId, limit: int = 20, after: int = 0
    ) -> tuple[list[VersionSummary], bool]:
        """The session's versions by number, `limit` at a time after number `after` (a cursor that
        names a deleted version, or none, still works: numbers only grow); whether more follow."""
        if not 1 <= limit <= MAX_LIST_LIMIT:
            raise InvalidInput(f"limit must be in [1, {MAX_LIST_LIMIT}]")
        with transaction(self._factory) as db:
            owned_session(db, user, sid)
            q = (
                select(*SUMMARY_COLS)
                .where(*version_key(user, sid), VersionRow.number > min(after, INT32_MAX))
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
            owned_session(db, user, sid)
            if with_body:
                return load_version(db, user, sid, number)
            where = (*version_key(user, sid), VersionRow.number == number)
            r = db.execute(select(*SUMMARY_COLS).where(*where)).one_or_none()
            if r is None:
                raise VersionNotFound(f"version {number} not found in session {sid!r}")
            return version_summary(r)

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
            owned_session(db, user, sid)
            candidates: list[tuple[int, int]] = []
            for chunk in in_chunks(want):
                q = select(VersionRow.number, VersionRow.n_messages, VersionRow.digest).where(
                    *version_key(user, sid), VersionRow.digest.in_(chunk)
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
            return load_version(db, user, sid, best[0])

    def version_tokens(self, user: UserId, sid: SessionId, numbers: Iterable[int]) -> dict[int, np.ndarray]:
        """The token ids of these versions of the session (for the retention sweeper: no messages
        are read or rebuilt); numbers it does not have are left out."""
        want = sorted(set(numbers))
        out: dict[int, np.ndarray] = {}
        with transaction(self._factory) as db:
            owned_session(db, user, sid)
            for chunk in in_chunks(want):
                q = select(VersionRow.number, VersionRow.tokens).where(
                    *version_key(user, sid), VersionRow.number.in_(chunk)
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
                owned_session(db, user, sid)
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
