"""Reading versions' token ids without their messages (`TokenReads`): for the retention sweeper,
for finding a deleted session's KV (`dss.ops.sessions`) and for the API's token listings.

A walk over a whole history (`iter_tokens`) holds one chunk of `_TOKEN_CHUNK` versions at a time,
never the history: it pages with a keyset on (session, number) inside one read transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from sqlalchemy import Select, bindparam, select, tuple_
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import transaction
from dss.db.models import VersionRow
from dss.dialogue.versions.records import VersionTokens
from dss.dialogue.versions.rows import in_chunks, owned_session, version_key
from dss.dialogue.versions.rules import EMPTY_TOKENS, INT32_MAX
from dss.tokens import TOKEN_DTYPE
from dss.types import FingerprintId, SessionId, UserId

# Versions whose token ids `iter_tokens` reads per query: what it holds at once is this many
# versions' ids (8 x 64 KiB at 16k tokens), whatever the length of the history it walks.
_TOKEN_CHUNK = 8


class TokenReads:
    """The token ids of a user's versions."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._factory = session_factory

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
