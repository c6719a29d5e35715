"""Public prefixes: admin-registered token prefixes (a shared system prompt) whose KV every user
of the model may load. Their rows live in `public_prefixes`; their pages in the fingerprint's
public namespace, optionally pinned (never evicted) through `KVCache.pins.set_pins`."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import transaction
from dss.db.models import PublicPrefixRow, aware
from dss.errors import InvalidInput, PrefixNotFound
from dss.index.fingerprints import FingerprintRegistry
from dss.jsonlimits import JsonLimits, check_items
from dss.ops.kv.cache import KVCache
from dss.tokens import as_tokens
from dss.types import PUBLIC_TENANT, FingerprintId


@dataclass(frozen=True, slots=True)
class PrefixInfo:
    id: str
    fingerprint: FingerprintId
    n_tokens: int
    pinned: bool
    text: str | None
    created_at: datetime  # aware, UTC
    cached_tokens: int


class PublicPrefixes:
    def __init__(
        self,
        session_factory: sessionmaker[Session],
        fingerprints: FingerprintRegistry,
        kv: KVCache,
        json_limits: JsonLimits | None = None,
    ) -> None:
        self._sf = session_factory
        self._json_limits = json_limits if json_limits is not None else JsonLimits()
        self._fingerprints = fingerprints
        self._kv = kv
        for fid in list(fingerprints):
            self._refresh_pins(fid)

    def register(
        self,
        fid: FingerprintId,
        tokens: Sequence[int] | np.ndarray,
        *,
        text: str | None = None,
        messages: list[dict[str, object]] | None = None,
        pin: bool = False,
    ) -> PrefixInfo:
        if messages is not None:
            check_items("messages", messages, self._json_limits)
        fp = self._fingerprints.get(fid)
        arr = as_tokens(tokens)
        if len(arr) < fp.block_size:
            raise InvalidInput(
                f"a public prefix must cover at least one full page ({fp.block_size} tokens); got {len(arr)}"
            )
        pid = "pfx_" + uuid.uuid4().hex[:24]
        with transaction(self._sf) as s:
            s.add(
                PublicPrefixRow(
                    id=pid,
                    fingerprint=fid,
                    n_tokens=len(arr),
                    tokens=arr.tobytes(),
                    text=text,
                    messages=messages,
                    pinned=pin,
                )
            )
        self._refresh_pins(fid)
        return self.get(pid)

    def get(self, pid: str) -> PrefixInfo:
        with self._sf() as s:
            row = s.get(PublicPrefixRow, pid)
            if row is None:
                raise PrefixNotFound(f"no public prefix {pid!r}")
            return self._info(row)

    def tokens(self, pid: str) -> np.ndarray:
        with self._sf() as s:
            row = s.get(PublicPrefixRow, pid)
            if row is None:
                raise PrefixNotFound(f"no public prefix {pid!r}")
            return np.frombuffer(row.tokens, dtype="<i4").copy()

    def registered(self, fid: FingerprintId) -> list[np.ndarray]:
        """The token ids of the prefixes registered for the model (a session's deletion computes
        the addresses its pages were saved under after them)."""
        with self._sf() as s:
            rows = s.execute(
                select(PublicPrefixRow.tokens).where(PublicPrefixRow.fingerprint == fid)
            ).scalars()
            return [np.frombuffer(t, dtype="<i4").copy() for t in rows]

    def list(self) -> list[PrefixInfo]:
        with self._sf() as s:
            rows = s.execute(
                select(PublicPrefixRow).order_by(PublicPrefixRow.created_at, PublicPrefixRow.id)
            ).scalars()
            return [self._info(r) for r in rows]

    def delete(self, pid: str) -> None:
        with transaction(self._sf) as s:
            row = s.get(PublicPrefixRow, pid)
            if row is None:
                raise PrefixNotFound(f"no public prefix {pid!r}")
            fid = FingerprintId(row.fingerprint)
            s.delete(row)
        self._refresh_pins(fid)

    def warmed(self, fid: FingerprintId, tokens: Sequence[int] | np.ndarray) -> bool:
        """Whether the public namespace stores the whole pages of `tokens` (what warming a
        prefix saves; the tokens after its last whole page are not waited for)."""
        bs = self._fingerprints.get(fid).block_size
        whole = len(tokens) // bs * bs
        return self._kv.match(fid, PUBLIC_TENANT, tokens).n_tokens >= whole

    def _info(self, row: PublicPrefixRow) -> PrefixInfo:
        fid = FingerprintId(row.fingerprint)
        tokens = np.frombuffer(row.tokens, dtype="<i4")
        cached = self._kv.match(fid, PUBLIC_TENANT, tokens).n_tokens if fid in self._fingerprints else 0
        created = aware(row.created_at)
        return PrefixInfo(row.id, fid, row.n_tokens, bool(row.pinned), row.text, created, cached)

    def _refresh_pins(self, fid: FingerprintId) -> None:
        with self._sf() as s:
            rows = s.execute(
                select(PublicPrefixRow.tokens).where(
                    PublicPrefixRow.fingerprint == fid, PublicPrefixRow.pinned.is_(True)
                )
            ).scalars()
            pinned = [np.frombuffer(t, dtype="<i4").copy() for t in rows]
        if fid in self._fingerprints:
            self._kv.pins.set_pins(fid, pinned)
