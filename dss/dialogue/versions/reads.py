"""Reading versions: one, all, a page, and the deepest one a message list extends (`VersionReads`).

A version's messages are stored as a delta on its parent's (`dss.dialogue.history`); every read
that returns messages rebuilds the whole list, and listings without bodies read no messages at
all. Numbers only grow, so a page cursor that names a deleted version (or none) still works.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import transaction
from dss.db.models import BranchRow, VersionRow
from dss.dialogue.history import prefix_digests, with_lead
from dss.dialogue.versions.records import (
    SUMMARY_COLS,
    VersionInfo,
    VersionSummary,
    full_version,
    version_summary,
)
from dss.dialogue.versions.rows import in_chunks, load_version, owned_session, version_key
from dss.dialogue.versions.rules import INT32_MAX, MAX_LIST_LIMIT, check_number, normalised
from dss.errors import InvalidInput, VersionNotFound
from dss.types import SessionId, UserId


class VersionReads:
    """A user's versions, with or without their bodies."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._factory = session_factory

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
