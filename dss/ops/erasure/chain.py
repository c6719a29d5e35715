"""The erasure receipts' hash chain, and the sealed checkpoints that keep checking it cheap.

Each receipt's `entry_hash` covers its own fields and the previous receipt's `entry_hash` (its
`prev_hash`; the first receipt links to `GENESIS`): a receipt edited or removed breaks a link.

Walking the chain from its start on every verification cost O(all receipts ever written)
(20,000 receipts: 1.1 s). Instead, verifying receipt k checks the receipts after the last
checkpoint before k, up to k, and records a checkpoint at every multiple of `CHECKPOINT_EVERY`
it passed. Once they exist, a verification reads at most `CHECKPOINT_EVERY` + 1 receipts; the
first verification after an upgrade (or after checkpoints were deleted) walks from the start,
once.

A checkpoint (table `chain_checkpoints`: seq, entry_hash, seal) says: the chain from its start
to receipt `seq` was found intact, and that receipt's entry hash was `entry_hash`. The seal is an
HMAC of both under the server secret (`Identity.seal`), which the database holds only wrapped by
the master key.

What it protects against: someone who can write the database but holds neither the master key
nor the server secret (a stolen or restored dump, a rogue database administrator).
- Editing or deleting receipt k, or any receipt between k's checkpoint and k: verifying k finds
  it (a link or a recomputed hash differs, or the checkpoint's receipt changed since).
- Adding a checkpoint past a broken link, so that verifications start after it: its seal does
  not verify, and the verification says so ("checkpoint #n is not sealed by this server").
- Deleting checkpoints: verifications walk further back (and write them again); nothing hides.
What one verification does not find: an edit of a receipt before k's checkpoint that keeps that
receipt's stored entry hash (the links after it still hold). Verifying that receipt finds it,
as does a full walk (`check_chain(..., full=True)`, `Eraser.verify(..., full=True)`). Whoever also
holds the server secret can rewrite the whole chain and its seals; that is outside this model.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from dss.db import receipt_rows
from dss.db.connect import transaction
from dss.db.models import ChainCheckpointRow
from dss.db.receipt_rows import ReceiptRecord
from dss.keys.identity import Identity

log = logging.getLogger("dss.erasure")

GENESIS = "0" * 64
# Receipts between two checkpoints: about what one verification re-hashes (~100 us each, read
# and hashed); each checkpoint costs a small write.
CHECKPOINT_EVERY = 64
_SEAL_LABEL = "dss-receipt-chain-checkpoint"


def entry_hash(
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


def _row_hash(row: ReceiptRecord) -> str:
    try:
        return entry_hash(row.prev_hash, row.id, row.seq, row.erased_at, row.subject, dict(row.counts))
    except (TypeError, ValueError):  # a row edited into something no receipt is: not intact
        return ""


def _seal(identity: Identity, seq: int, entry: str) -> str:
    return identity.seal(_SEAL_LABEL, str(seq), entry)


def _sealed(identity: Identity, checkpoint: ChainCheckpointRow) -> bool:
    # As bytes: a seal edited to non-ASCII text must fail the comparison, not raise.
    expected = _seal(identity, checkpoint.seq, checkpoint.entry_hash)
    return hmac.compare_digest(checkpoint.seal.encode(), expected.encode())


@dataclass(frozen=True, slots=True)
class ChainCheck:
    """The chain up to a receipt: intact or not (`problem` says where), and how many receipt
    rows the check read (what it cost)."""

    ok: bool
    problem: str | None
    rows_read: int


def check_chain(
    sf: sessionmaker[Session], identity: Identity, upto_seq: int, full: bool = False
) -> ChainCheck:
    """Whether the chain is intact from its start up to receipt `upto_seq`: from the last sealed
    checkpoint before it (`full`: from the start, whatever the checkpoints say). Seals new
    checkpoints at the multiples of `CHECKPOINT_EVERY` it found intact."""
    with sf() as s:
        start = None
        if not full:
            start = s.execute(
                select(ChainCheckpointRow)
                .where(ChainCheckpointRow.seq < upto_seq)
                .order_by(ChainCheckpointRow.seq.desc())
                .limit(1)
            ).scalar()
        if start is not None and not _sealed(identity, start):
            return ChainCheck(False, f"audit chain: checkpoint #{start.seq} is not sealed by this server", 0)
        first_seq = start.seq if start is not None else 1
        rows = receipt_rows.between_in(s, first_seq, upto_seq)
    n_read = len(rows)
    prev, expected = GENESIS, 1
    if start is not None:
        first = rows[0] if rows else None
        if first is None or first.seq != start.seq or first.entry_hash != start.entry_hash:
            changed = f"audit chain broken at receipt #{start.seq} (changed since its checkpoint)"
            return ChainCheck(False, changed, n_read)
        prev, expected = start.entry_hash, start.seq + 1
        rows = rows[1:]
    problem: str | None = None
    reached: list[tuple[int, str]] = []
    for row in rows:
        if row.seq != expected:
            problem = f"audit chain broken at receipt #{expected} (missing)"
            break
        if row.prev_hash != prev or _row_hash(row) != row.entry_hash:
            problem = f"audit chain broken at receipt #{row.seq}"
            break
        if row.seq % CHECKPOINT_EVERY == 0:
            reached.append((row.seq, row.entry_hash))
        prev, expected = row.entry_hash, expected + 1
    if problem is None and expected != upto_seq + 1:
        problem = f"audit chain broken at receipt #{expected} (missing)"
    _record_checkpoints(sf, identity, reached)
    return ChainCheck(problem is None, problem, n_read)


def _record_checkpoints(
    sf: sessionmaker[Session], identity: Identity, reached: list[tuple[int, str]]
) -> None:
    """Seal checkpoints found intact. Only a shortcut for later verifications: two verifications
    sealing the same one, or a busy database, are not errors."""
    if not reached:
        return
    try:
        with transaction(sf) as s:
            have = set(
                s.execute(
                    select(ChainCheckpointRow.seq).where(ChainCheckpointRow.seq.in_([q for q, _ in reached]))
                ).scalars()
            )
            for seq, entry in reached:
                if seq not in have:
                    s.add(ChainCheckpointRow(seq=seq, entry_hash=entry, seal=_seal(identity, seq, entry)))
    except (IntegrityError, OperationalError) as exc:
        log.info("receipt chain: checkpoints not recorded this time (%s)", type(exc).__name__)
