"""Erasing a user (GDPR/CCPA) and proving it.

Order matters. First the user's pages leave the page table and the index (no reader can have
them any more) while saves of the user are refused (`KVCache.erasing`) and moves in flight
settle; then the database transaction (sessions, versions, stored responses, page rows, the
data key, and the receipt) commits; then the irreversible steps run (zeroing host slots, unlinking files).
Destroying the data key is what makes any copy of the user's pages that we cannot reach (a
backup) unreadable. Public-prefix pages are not user data and stay.

A receipt records counts, a time and the subject's salted hash (its tenant id), never content.
Receipts form an append-only hash chain; `verify` re-scans the database and every tier for
anything of the subject older than the erasure, and checks the chain up to the receipt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, delete, func, select
from sqlalchemy.orm import Session, sessionmaker

from dss.db import models as m
from dss.db.engine import BUSY_TIMEOUT_MS, transaction
from dss.dialogue.versions import VersionStore
from dss.errors import ReceiptNotFound
from dss.index.prefix_index import PrefixIndex
from dss.keys.identity import Identity
from dss.keys.keyring import Keyring
from dss.ops.kv import KVCache
from dss.pages.manager import TieredPages
from dss.types import PUBLIC_TENANT, TenantId, Tier

log = logging.getLogger("dss.erasure")
_SETTLE_S = 30.0
_CHECKPOINT_ATTEMPTS = 5
_CHECKPOINT_WAIT_MS = 200
_CHECKPOINT_PAUSE_S = 0.1


GENESIS = "0" * 64
_append_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class ErasureReceipt:
    id: str
    seq: int
    erased_at: datetime
    subject: str
    counts: dict[str, Any]
    prev_hash: str
    entry_hash: str
    # Whether SQLite's WAL was checkpointed and truncated after the erasure (None: not SQLite,
    # or a receipt read back later; `verify` checks again). Not part of the hashed entry.
    database_scrubbed: bool | None = None


@dataclass(frozen=True, slots=True)
class Verification:
    receipt_id: str
    checked_at: datetime
    remnants: int
    details: tuple[str, ...]
    chain_ok: bool
    database_scrubbed: bool | None = None


def _entry_hash(
    prev_hash: str, rid: str, seq: int, erased_at: datetime, subject: str, counts: dict[str, Any]
) -> str:
    body = json.dumps(
        {"id": rid, "seq": seq, "erased_at": _iso(erased_at), "subject": subject, "counts": counts},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256((prev_hash + body).encode()).hexdigest()


def _iso(t: datetime) -> str:
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.astimezone(UTC).isoformat(timespec="microseconds")


def _receipt(row: m.ErasureReceiptRow) -> ErasureReceipt:
    erased = row.erased_at if row.erased_at.tzinfo else row.erased_at.replace(tzinfo=UTC)
    return ErasureReceipt(
        row.id, row.seq, erased, row.subject, dict(row.counts), row.prev_hash, row.entry_hash
    )


class Eraser:
    """Erases users and verifies erasures, over the parts that hold their data."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        db: Engine,
        versions: VersionStore,
        identity: Identity,
        keyring: Keyring,
        index: PrefixIndex,
        pages: TieredPages,
        kv: KVCache,
    ) -> None:
        self._sf = session_factory
        self._db = db
        self._versions = versions
        self._identity = identity
        self._keyring = keyring
        self._index = index
        self._pages = pages
        self._kv = kv

    def erase_user(self, user: str) -> ErasureReceipt:
        tenant = self._identity.tenant_for(user)
        if tenant == PUBLIC_TENANT:  # cannot happen (an HMAC is hex), but never erase shared pages
            raise ValueError("refusing to erase the public tenant")
        with self._kv.erasing(tenant):
            # From here the tenant gets no data key: nothing of it is written or read again.
            self._keyring.retire(tenant)
            usage = self._pages.tenant_usage(tenant)
            # Out of the page table and the index at once: no reader can have them from now on.
            detached, gone = self._pages.detach(self._pages.table.pages_of_tenant(tenant))
            self._index.drop_tenant(tenant)
            # Moves of those pages in flight (the writer, a promotion) finish and delete their
            # own copies; only then are the rows below final.
            mine = {e.meta.hash for e in detached}
            if not self._pages.wait_settled([h for h in gone if h not in mine], _SETTLE_S):
                log.warning("erasure: some pages were still being moved after %ss", _SETTLE_S)
            erased_at = datetime.now(UTC)
            rid = "era_" + uuid.uuid4().hex[:24]
            try:
                with transaction(self._sf) as s:
                    counts = _delete_rows(s, user, tenant, self._versions, self._keyring, usage)
                    # The user's next tenant: a re-created user starts cold everywhere.
                    counts["epoch"] = self._identity.next_epoch_in(s, user)
                    seq, prev, entry = _append_receipt(s, rid, erased_at, tenant, counts)
            except BaseException:
                self._pages.abandon(detached)  # nothing was erased; recovery finds the files
                self._keyring.unretire(tenant)
                raise
            self._identity.forget(user)
            # Committed: now the irreversible part.
            self._keyring.forget_cached(tenant)
            self._pages.destroy(detached, rows_deleted=True)
        scrubbed = scrub_database(self._db)
        return ErasureReceipt(rid, seq, erased_at, tenant, counts, prev, entry, scrubbed)

    def get_receipt(self, receipt_id: str) -> ErasureReceipt:
        return get_receipt(self._sf, receipt_id)

    def verify(self, receipt_id: str) -> Verification:
        return verify(self._sf, self._db, self._identity, self._pages, receipt_id)


def _delete_rows(
    s: Session,
    user: str,
    tenant: TenantId,
    versions: VersionStore,
    keyring: Keyring,
    usage: dict[Tier, tuple[int, int]],
) -> dict[str, Any]:
    dialogue = versions.delete_user_sessions(user, s)
    n_page_rows = cast(
        CursorResult[Any], s.execute(delete(m.PageRow).where(m.PageRow.tenant == tenant))
    ).rowcount
    n_keys = keyring.destroy_in(s, tenant)
    return {
        "sessions": dialogue["sessions"],
        "versions": dialogue["versions"],
        "branches": dialogue["branches"],
        "responses": dialogue["responses"],
        "page_rows": int(n_page_rows),
        "data_keys_destroyed": n_keys,
        "pages": {t.value: usage[t][0] for t in Tier},
        "bytes": {t.value: usage[t][1] for t in Tier},
    }


def _append_receipt(
    s: Session, rid: str, erased_at: datetime, subject: str, counts: dict[str, Any]
) -> tuple[int, str, str]:
    with _append_lock:  # one chain: receipts of two erasures in this process never interleave
        last = s.execute(
            select(m.ErasureReceiptRow).order_by(m.ErasureReceiptRow.seq.desc()).limit(1)
        ).scalar()
        seq = (last.seq + 1) if last else 1
        prev = last.entry_hash if last else GENESIS
        entry = _entry_hash(prev, rid, seq, erased_at, subject, counts)
        s.add(
            m.ErasureReceiptRow(
                id=rid,
                seq=seq,
                erased_at=erased_at,
                subject=subject,
                counts=counts,
                prev_hash=prev,
                entry_hash=entry,
            )
        )
        s.flush()
    return seq, prev, entry


def scrub_database(db: Engine) -> bool | None:
    """Make SQLite's copies of deleted rows go away; whether that worked (None: not SQLite).

    `secure_delete` zeroes freed pages, but only once they are checkpointed from the WAL into
    the database file, and a reader holding an old snapshot keeps the checkpoint from finishing
    (the erased rows then stay in the WAL file). So the checkpoint is retried a few times, each
    waiting briefly for readers, and its result is reported, not assumed.
    """
    if db.dialect.name != "sqlite":
        return None
    with db.connect() as c:
        try:
            c.exec_driver_sql(f"PRAGMA busy_timeout={_CHECKPOINT_WAIT_MS}")
            for attempt in range(_CHECKPOINT_ATTEMPTS):
                busy, log_frames, moved = c.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").one()
                if busy == 0 and log_frames == moved:
                    return True
                if attempt + 1 < _CHECKPOINT_ATTEMPTS:
                    time.sleep(_CHECKPOINT_PAUSE_S)
            log.warning("erasure: a reader kept the WAL checkpoint from finishing; erased rows may linger")
            return False
        finally:
            c.exec_driver_sql(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")


def get_receipt(sf: sessionmaker[Session], receipt_id: str) -> ErasureReceipt:
    with sf() as s:
        row = s.get(m.ErasureReceiptRow, receipt_id)
        if row is None:
            raise ReceiptNotFound(f"no erasure receipt {receipt_id!r}")
        return _receipt(row)


def verify(
    sf: sessionmaker[Session], db: Engine, identity: Identity, pages: TieredPages, receipt_id: str
) -> Verification:
    """Re-scan the database and every tier for anything of the receipt's subject (since the erasure
    retired it: anything at all; for receipts older than erasure epochs: what predates them)."""
    receipt = get_receipt(sf, receipt_id)
    tenant = TenantId(receipt.subject)
    # A receipt that moved the user's epoch retired its tenant for good: anything of that tenant,
    # whenever it was written, is a remnant. Older receipts (before epochs) count what predates them.
    retired = "epoch" in receipt.counts
    cutoff = datetime.max.replace(tzinfo=UTC) if retired else receipt.erased_at
    cutoff_ts = float("inf") if retired else cutoff.timestamp()
    details: list[str] = []
    with sf() as s:
        chain = list(
            s.execute(
                select(m.ErasureReceiptRow)
                .where(m.ErasureReceiptRow.seq <= receipt.seq)
                .order_by(m.ErasureReceiptRow.seq)
            ).scalars()
        )
        # Rows keyed by a user id: those of every user the subject's tenant was ever the tenant
        # of, written before the erasure (after it, they belong to the user's next epoch).
        users = set(s.execute(select(m.SessionRow.user_id).distinct()).scalars())
        users |= set(s.execute(select(m.ResponseRow.user_id).distinct()).scalars())
        mine = sorted(u for u in users if tenant in identity.tenants_of(u))
        if mine:
            for what, table in (("session", m.SessionRow), ("stored response", m.ResponseRow)):
                old = s.execute(
                    select(func.count())
                    .select_from(table)
                    .where(table.user_id.in_(mine), table.created_at <= receipt.erased_at)
                ).scalar_one()
                if old:
                    details.append(f"database: {old} {what}(s) created before the erasure")
        rows = s.execute(
            select(func.count())
            .select_from(m.PageRow)
            .where(m.PageRow.tenant == tenant, m.PageRow.created_at <= cutoff)
        ).scalar_one()
        if rows:
            details.append(f"database: {rows} page row(s)")
        keys = s.execute(
            select(func.count())
            .select_from(m.DataKey)
            .where(m.DataKey.tenant == tenant, m.DataKey.created_at <= cutoff)
        ).scalar_one()
        if keys:
            details.append("database: the data key still exists")
    chain_ok = True
    prev = GENESIS
    for row in chain:
        r = _receipt(row)
        if (
            r.prev_hash != prev
            or _entry_hash(prev, r.id, r.seq, r.erased_at, r.subject, r.counts) != r.entry_hash
        ):
            chain_ok = False
            details.append(f"audit chain broken at receipt #{r.seq}")
            break
        prev = r.entry_hash
    for e in pages.table.snapshot(tenant):
        if e.created_wall <= cutoff_ts:
            details.append(f"{'/'.join(sorted(t.value for t in e.tiers))}: page {e.meta.hash.hex()[:16]}")
    if pages.disk is not None:
        for h, header, _size in pages.disk.scan():
            if header.tenant == tenant:
                path = pages.disk.path_of(h)
                mtime = os.path.getmtime(path) if os.path.exists(path) else 0.0
                if mtime <= cutoff_ts:
                    details.append(f"disk: page file {h.hex()[:16]}")
    scrubbed = scrub_database(db)
    if scrubbed is False:
        details.append("database: a reader keeps the WAL from being checkpointed; erased rows may linger")
    return Verification(receipt.id, datetime.now(UTC), len(details), tuple(details), chain_ok, scrubbed)
