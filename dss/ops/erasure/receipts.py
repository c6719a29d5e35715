"""Erasure receipts: what an erasure hands back and appends to the chain, and reading them.

A receipt records counts, a time and the subject's salted hash (its tenant id), never content.
Receipts form an append-only hash chain (`dss.ops.erasure.chain`); their rows are kept by
`dss.db.receipt_rows`, the `erasure_receipts` table's owner. Appending is serialised by the
database, not by a Python lock (see `append_receipt`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from dss.db import receipt_rows
from dss.db.receipt_rows import ReceiptRecord
from dss.errors import ReceiptNotFound
from dss.fleet.erasures import FleetReport, fleet_report
from dss.ops.erasure.chain import GENESIS, entry_hash
from dss.types import TenantId

# Arbitrary constant naming the advisory lock that serialises appends to the receipt chain
# across the servers of a fleet and the threads of each (see `append_receipt`).
_CHAIN_LOCK_KEY = 0x44535302


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
    # Per server of the fleet, what it dropped, and who has not acknowledged (None: one server,
    # SQLite). From `erasure_acks`, not part of the hashed entry either.
    fleet: FleetReport | None = None


def _receipt(row: ReceiptRecord, fleet: FleetReport | None = None) -> ErasureReceipt:
    counts = dict(row.counts)
    if fleet is not None:
        # Deleted after the commit by the erasing server, so not in the hashed entry: it is in
        # that server's acknowledgement (the remote tier is the fleet's, only it erases there).
        remote = [c["remote_keys"] for c in fleet.servers.values() if "remote_keys" in c]
        if remote:
            counts["remote_keys"] = remote[0]
    return ErasureReceipt(
        row.id, row.seq, row.erased_at_utc, row.subject, counts, row.prev_hash, row.entry_hash, fleet=fleet
    )


def append_receipt(
    s: Session,
    rid: str,
    erased_at: datetime,
    subject: str,
    counts: dict[str, Any],
    user_subject: str | None = None,
) -> tuple[int, str, str]:
    """Append the receipt of tenant `subject`; `user_subject`: the erased user's subject hash
    (outside the hashed entry), by which `verify` finds the user's rows."""
    # One chain: two erasures' receipts never interleave, serialised by the database rather
    # than by a Python lock (no lock of this process is held across the queries below). On
    # PostgreSQL, by an advisory lock held until the transaction ends (threads and servers alike);
    # on SQLite, by its one write lock, which the caller's transaction already holds (its first
    # write, the epoch row's, came before) and keeps until it commits.
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _CHAIN_LOCK_KEY})
    last = receipt_rows.last_in(s)
    seq = (last.seq + 1) if last else 1
    prev = last.entry_hash if last else GENESIS
    entry = entry_hash(prev, rid, seq, erased_at, subject, counts)
    receipt_rows.add_in(s, ReceiptRecord(rid, seq, erased_at, subject, counts, prev, entry, user_subject))
    return seq, prev, entry


def never_erased(s: Session, tenants: list[TenantId]) -> list[TenantId]:
    """Those of `tenants` no receipt names: none, unless an erasure ran before erasures of
    a user were serialised. (A tenant a receipt names is erased, and retired, by the erasure
    that wrote it, and on every other server of the fleet by its follower.)"""
    named = receipt_rows.subjects_in(s, list(tenants))
    return [t for t in tenants if t not in named]


def erased_pseudonym(tenant: TenantId) -> str:
    """What the audit trail names an erased user by: the tenant its erasure retired (a keyed hash
    of the id and the epoch, the receipt's `subject`), never the id."""
    return f"erased:{tenant}"


def user_subject_of(sf: sessionmaker[Session], receipt_id: str) -> str | None:
    """The erased user's subject hash the receipt carries (None: written before migration 0013)."""
    with sf() as s:
        row = receipt_rows.get_in(s, receipt_id)
    return row.user_subject if row is not None else None


def get_receipt(sf: sessionmaker[Session], receipt_id: str) -> ErasureReceipt:
    with sf() as s:
        row = receipt_rows.get_in(s, receipt_id)
        if row is None:
            raise ReceiptNotFound(f"no erasure receipt {receipt_id!r}")
    return _receipt(row, fleet_report(sf, receipt_id))


def list_receipts(
    sf: sessionmaker[Session], limit: int, after: str | None = None
) -> tuple[list[ErasureReceipt], bool]:
    """Receipts newest first (by chain position), `limit` of them after the receipt `after`;
    and whether more follow. The fleet sections are left out (`get_receipt` has them)."""
    with sf() as s:
        below = None
        if after is not None:
            cursor = receipt_rows.get_in(s, after)
            if cursor is None:
                raise ReceiptNotFound(f"no erasure receipt {after!r}")
            below = cursor.seq
        rows = receipt_rows.newest_in(s, limit + 1, below)
    return [_receipt(r) for r in rows[:limit]], len(rows) > limit
