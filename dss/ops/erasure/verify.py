"""Verifying an erasure: re-scan the database and every tier for anything of the receipt's
subject, check the chain up to the receipt, and say whether the WAL is scrubbed of it.

What one verification costs follows what its receipt covers, not all data: the chain since the
last sealed checkpoint before the receipt (`dss.ops.erasure.chain`: one every 64 receipts,
sealed by the first verification that passes it); the tenant's entries in the page table and its
files on the disk tier (the tier indexes files by tenant; only files it does not know are
opened); counts by indexed columns; and no blocking WAL checkpoint (`dss.ops.erasure.wal_scrub`: the
erasure scrubs, a verification reads what was done); and the erased user's sessions and stored
responses by the subject hash the receipt and each such row carry (`user_subject`, `subject`,
migration 0013), not by hashing every user id of the store. Only rows written before that
migration are still matched that way (`Identity.users_having`, over their owners alone).
`verify(..., full=True)` is the audit that walks everything.

Each table is asked through its owner: the dialogue's rows (`dss.dialogue.users`), the page rows
(`dss.pages.rows`), the data key (`Keyring`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial

from sqlalchemy.orm import Session, sessionmaker

from dss.dialogue.users import rows_created_by
from dss.errors import TierUnavailable
from dss.keys.identity import Identity
from dss.keys.keyring import Keyring
from dss.ops.erasure.chain import check_chain
from dss.ops.erasure.receipts import get_receipt, user_subject_of
from dss.ops.erasure.wal_scrub import WalScrubber
from dss.pages.placement import TieredPages
from dss.pages.rows import count_tenant_in
from dss.types import TenantId


@dataclass(frozen=True, slots=True)
class Verification:
    receipt_id: str
    checked_at: datetime
    remnants: int
    details: tuple[str, ...]
    chain_ok: bool
    database_scrubbed: bool | None = None


def local_remnants(pages: TieredPages, tenant: TenantId, cutoff_ts: float, full: bool = False) -> list[str]:
    """What this server's page table and disk tier still hold of `tenant` (written by `cutoff_ts`).

    The disk tier's files of the tenant (`DiskTier.tenant_files`): those it wrote or scanned for
    the tenant, a racing writer's late file included, and any file it does not know whose header
    names the tenant (a restored backup); no header of another tenant's known file is read.
    `full`: every file's header instead (`DiskTier.scan`, which also removes corrupt files)."""
    details: list[str] = []
    for e in pages.table.snapshot(tenant):
        if e.created_wall <= cutoff_ts:
            details.append(f"{'/'.join(sorted(t.value for t in e.tiers))}: page {e.meta.hash.hex()[:16]}")
    disk = pages.disk
    if disk is not None:
        if full:
            files = [h for h, header, _size in disk.scan() if header.tenant == tenant]
        else:
            files = disk.tenant_files(tenant)
        for h in files:
            try:
                mtime = os.path.getmtime(disk.path_of(h))
            except FileNotFoundError:
                continue  # deleted meanwhile
            if mtime <= cutoff_ts:
                details.append(f"disk: page file {h.hex()[:16]}")
    return details


def verify(
    sf: sessionmaker[Session],
    wal: WalScrubber,
    identity: Identity,
    keyring: Keyring,
    pages: TieredPages,
    receipt_id: str,
    full: bool = False,
) -> Verification:
    """Re-scan the database and every tier for anything of the receipt's subject (since the erasure
    retired it: anything at all; for receipts older than erasure epochs: what predates them), check
    the chain up to the receipt, and report whether the WAL is scrubbed of it.

    Its cost follows the receipt, not all data (see the module docstring); `full` walks the whole
    chain and reads every page file's header instead (an audit)."""
    receipt = get_receipt(sf, receipt_id)
    tenant = TenantId(receipt.subject)
    # A receipt that moved the user's epoch retired its tenant for good: anything of that tenant,
    # whenever it was written, is a remnant. Older receipts (before epochs) count what predates them.
    retired = "epoch" in receipt.counts
    cutoff = datetime.max.replace(tzinfo=UTC) if retired else receipt.erased_at
    cutoff_ts = float("inf") if retired else cutoff.timestamp()
    details: list[str] = []
    user_subject = user_subject_of(sf, receipt.id)
    with sf() as s:
        # The erased user's sessions and stored responses created before the erasure (after it,
        # they belong to the user's next epoch).
        user_rows = rows_created_by(
            s, user_subject, receipt.erased_at, partial(identity.users_having, tenant)
        )
        details.extend(
            f"database: {n} {what}(s) created before the erasure" for what, n in user_rows.items() if n
        )
        rows = count_tenant_in(s, tenant, cutoff)
        if rows:
            details.append(f"database: {rows} page row(s)")
    if keyring.key_created_by(tenant, cutoff):
        details.append("database: the data key still exists")
    chain = check_chain(sf, identity, receipt.seq, full=full)
    if chain.problem is not None:
        details.append(chain.problem)
    details.extend(local_remnants(pages, tenant, cutoff_ts, full=full))
    if receipt.fleet is not None:
        # Servers alive at the erasure that have not dropped their copies yet (down, or slow).
        details.extend(f"server {sid}: has not acknowledged the erasure" for sid in receipt.fleet.unanswered)
        details.extend(
            f"server {sid}: "
            + (
                "its disk tier could not be scanned after it applied the erasure"
                if n < 0
                else f"{n} cop(ies) left after it applied the erasure"
            )
            for sid, n in sorted(receipt.fleet.remnants.items())
            if n
        )
    if pages.remote is not None:
        try:
            left = pages.remote.count_tenant(tenant)
        except TierUnavailable as exc:
            details.append(f"remote: not checked, the remote tier did not answer ({exc})")
        else:
            if left:
                details.append(f"remote: {left} key(s) of the tenant")
    scrubbed = wal.scrubbed(receipt.seq)
    if scrubbed is False:
        details.append("database: a reader keeps the WAL from being checkpointed; erased rows may linger")
    return Verification(receipt.id, datetime.now(UTC), len(details), tuple(details), chain.ok, scrubbed)
