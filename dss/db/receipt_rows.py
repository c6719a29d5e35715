"""The `erasure_receipts` table: the rows of the append-only, hash-chained erasure receipts.

Its one owner (`dss.db.models.TABLE_OWNERS`), below the parts because three of them read it: the
erasure appends and reads receipts (`dss.ops.erasure.eraser`, `dss.ops.erasure.chain` walks the
chain, `dss.ops.erasure.wal_scrub` notes the last seq a checkpoint covers), the fleet's follower
catches up by their seq (`dss.fleet`), and the keyring learns the retired tenants from them
(`dss.keys`). What a receipt means (its hash, the lock that keeps the chain one line) is the
erasure's; this module only stores and finds rows. Every function works in the caller's session, so
an append is part of the erasure's one transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, func, select
from sqlalchemy.orm import Session

from dss.db.models import ErasureReceiptRow, aware


@dataclass(frozen=True, slots=True)
class ReceiptRecord:
    """One stored receipt. `erased_at` as stored (SQLite hands it back naive, and the chain's
    hash reads it so); `user_subject`: the erased user's subject hash, outside the hashed entry."""

    id: str
    seq: int
    erased_at: datetime
    subject: str
    counts: dict[str, Any]
    prev_hash: str
    entry_hash: str
    user_subject: str | None = None

    @property
    def erased_at_utc(self) -> datetime:
        return aware(self.erased_at)


def _record(row: ErasureReceiptRow) -> ReceiptRecord:
    return ReceiptRecord(
        row.id,
        row.seq,
        row.erased_at,
        row.subject,
        row.counts,
        row.prev_hash,
        row.entry_hash,
        row.user_subject,
    )


def add_in(s: Session, receipt: ReceiptRecord) -> None:
    s.add(
        ErasureReceiptRow(
            id=receipt.id,
            seq=receipt.seq,
            erased_at=receipt.erased_at,
            subject=receipt.subject,
            counts=receipt.counts,
            prev_hash=receipt.prev_hash,
            entry_hash=receipt.entry_hash,
            user_subject=receipt.user_subject,
        )
    )
    s.flush()


def last_in(s: Session) -> ReceiptRecord | None:
    """The receipt at the end of the chain (the highest seq), None before the first."""
    row = s.execute(select(ErasureReceiptRow).order_by(ErasureReceiptRow.seq.desc()).limit(1)).scalar()
    return _record(row) if row is not None else None


def get_in(s: Session, receipt_id: str) -> ReceiptRecord | None:
    row = s.get(ErasureReceiptRow, receipt_id)
    return _record(row) if row is not None else None


def newest_in(s: Session, limit: int, below_seq: int | None = None) -> list[ReceiptRecord]:
    """Up to `limit` receipts, newest first, with a seq below `below_seq` if given."""
    q = select(ErasureReceiptRow).order_by(ErasureReceiptRow.seq.desc()).limit(limit)
    if below_seq is not None:
        q = q.where(ErasureReceiptRow.seq < below_seq)
    return [_record(r) for r in s.scalars(q)]


def between_in(s: Session, first_seq: int, last_seq: int) -> list[ReceiptRecord]:
    """The receipts with a seq in [first_seq, last_seq], in seq order."""
    q = (
        select(ErasureReceiptRow)
        .where(ErasureReceiptRow.seq >= first_seq, ErasureReceiptRow.seq <= last_seq)
        .order_by(ErasureReceiptRow.seq)
    )
    return [_record(r) for r in s.scalars(q)]


def after_in(s: Session, seq: int) -> list[ReceiptRecord]:
    """The receipts after `seq`, in seq order (a follower's catch-up)."""
    q = select(ErasureReceiptRow).where(ErasureReceiptRow.seq > seq).order_by(ErasureReceiptRow.seq)
    return [_record(r) for r in s.scalars(q)]


def last_seq_in(s: Session | Connection) -> int:
    """The chain's highest seq, 0 when it is empty. In a session, or on a connection (the WAL
    scrubber reads it on the connection it then checkpoints with)."""
    return int(s.execute(select(func.coalesce(func.max(ErasureReceiptRow.seq), 0))).scalar_one())


def any_in(s: Session) -> bool:
    return s.scalar(select(ErasureReceiptRow.id).limit(1)) is not None


def subjects_in(s: Session, among: list[str]) -> set[str]:
    """Those of the subjects (tenants) `among` that some receipt names."""
    if not among:
        return set()
    return set(s.scalars(select(ErasureReceiptRow.subject).where(ErasureReceiptRow.subject.in_(among))))


def retired_subjects_in(s: Session) -> set[str]:
    """The subjects (tenants) of every receipt that moved its user's erasure epoch: retired for
    good (`counts["epoch"]`; receipts from before epochs retired nothing)."""
    rows = s.execute(select(ErasureReceiptRow.subject, ErasureReceiptRow.counts)).all()
    return {subject for subject, counts in rows if "epoch" in (counts or {})}
