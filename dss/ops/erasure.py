"""Erasing a user (GDPR/CCPA) and proving it.

Order matters. First the user's pages leave the page table and the index (no reader can have
them any more) while saves of the user are refused (`KVCache.erasing`) and moves in flight
settle; then the database transaction (sessions, versions, stored responses, page rows, the
data key, the user's id in the admin audit trail replaced by a pseudonym, and the receipt)
commits; then the irreversible steps run (zeroing host slots, unlinking files).
Destroying the data key is what makes any copy of the user's pages that we cannot reach (a
backup) unreadable. Public-prefix pages are not user data and stay.

A receipt records counts, a time and the subject's salted hash (its tenant id), never content.
Receipts form an append-only hash chain; `verify` re-scans the database and every tier for
anything of the subject older than the erasure, and checks the chain up to the receipt.

What one verification costs follows what its receipt covers, not all data: the chain since the
last sealed checkpoint before the receipt (`dss.ops.receipt_chain`: one every 64 receipts,
sealed by the first verification that passes it); the tenant's entries in the page table and its
files on the disk tier (the tier indexes files by tenant; only files it does not know are
opened); counts by indexed columns; and no blocking WAL checkpoint (`dss.ops.wal_scrub`: the
erasure scrubs, a verification reads what was done); and the erased user's sessions and stored
responses by the subject hash the receipt and each such row carry (`user_subject`, `subject`,
migration 0013), not by hashing every user id of the store. Only rows written before that
migration are still matched that way (`Identity.users_having`, over their owners alone).
`verify(..., full=True)` is the audit that walks everything.

Several servers on one PostgreSQL database (`dss.fleet`): the rows and the data key are shared
and go in the one transaction; each server's own copies (host arena, disk tier) are dropped by
that server. The erasing server notifies the others in its transaction and waits (bounded) for
their acknowledgements after it; each other server applies the receipt
(`apply_fleet_erasure`) and acknowledges it. The receipt's `fleet` section lists them, and
`verify` reports servers alive at the erasure that have not acknowledged it yet. The remote page
tier (Redis, shared by the fleet) is emptied of the tenant by the erasing server after the commit.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, delete, func, select, text
from sqlalchemy.orm import Session, sessionmaker

from dss.db import models as m
from dss.db.connect import transaction
from dss.dialogue.versions import VersionStore
from dss.errors import ReceiptNotFound, TierUnavailable
from dss.fleet.erasures import (
    FleetReport,
    LocalErasure,
    PendingReceipt,
    fleet_report,
    record_erasure_in,
    update_own_counts,
    wait_for_acks,
)
from dss.fleet.members import Membership
from dss.index.prefix_index import PrefixIndex
from dss.keys.identity import Identity
from dss.keys.keyring import Keyring
from dss.ops.kv import KVCache
from dss.ops.receipt_chain import GENESIS, check_chain, entry_hash
from dss.ops.wal_scrub import WalScrubber
from dss.pages.table import PageEntry
from dss.pages.tiered import TieredPages
from dss.types import PUBLIC_TENANT, TenantId, Tier, UserId

log = logging.getLogger("dss.erasure")
_SETTLE_S = 30.0

# Arbitrary constant naming the advisory lock that serialises appends to the receipt chain
# across the servers of a fleet and the threads of each (see `_append_receipt`).
_CHAIN_LOCK_KEY = 0x44535302
# The first key of the two-key advisory locks that serialise erasures of one user across the
# fleet (the second: 32 bits of the user's subject hash). PostgreSQL keeps two-key locks apart
# from one-key ones such as the chain's, so the two never collide.
_USER_LOCK_CLASS = 0x44535303


class _OneErasurePerUser:
    """Erasures of one user in this process, one at a time (per subject hash).

    An outer lock, the one exception to "locks are leaves": held for a whole erasure (which takes
    the leaf locks of the page table, the index, the keyring, and does I/O under it), it is taken
    only by `Eraser.erase_user`, first, with no other lock held, and nothing under it takes it
    again, so no lock order can form around it. `_guard` (a leaf) guards the table of them."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}  # subject -> (lock, users of it)

    @contextmanager
    def holding(self, subject: str) -> Iterator[None]:
        with self._guard:
            lock, n = self._locks.get(subject, (threading.Lock(), 0))
            self._locks[subject] = (lock, n + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, n = self._locks[subject]
                if n == 1:
                    del self._locks[subject]
                else:
                    self._locks[subject] = (lock, n - 1)


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


@dataclass(frozen=True, slots=True)
class Verification:
    receipt_id: str
    checked_at: datetime
    remnants: int
    details: tuple[str, ...]
    chain_ok: bool
    database_scrubbed: bool | None = None


def _receipt(row: m.ErasureReceiptRow, fleet: FleetReport | None = None) -> ErasureReceipt:
    erased = m.aware(row.erased_at)
    counts = dict(row.counts)
    if fleet is not None:
        # Deleted after the commit by the erasing server, so not in the hashed entry: it is in
        # that server's acknowledgement (the remote tier is the fleet's, only it erases there).
        remote = [c["remote_keys"] for c in fleet.servers.values() if "remote_keys" in c]
        if remote:
            counts["remote_keys"] = remote[0]
    return ErasureReceipt(
        row.id, row.seq, erased, row.subject, counts, row.prev_hash, row.entry_hash, fleet=fleet
    )


OnTenantErased = Callable[[TenantId], None]


class Eraser:
    """Erases users and verifies erasures, over the parts that hold their data.

    `membership` is None for a single server (SQLite): no acknowledgements, no notification, and
    `erase_user` does not wait for anyone. `on_tenant_erased` is called when another server's
    erasure is applied here, before this server's copies are dropped (the API stops the tenant's
    running generations with it); it runs on the fleet follower thread, with no lock held.
    """

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
        server_id: str = "",
        membership: Membership | None = None,
        ack_timeout_s: float = 5.0,
        on_tenant_erased: OnTenantErased | None = None,
        on_user_erased: Callable[[UserId], None] | None = None,
    ) -> None:
        self._sf = session_factory
        self._db = db
        self._versions = versions
        self._identity = identity
        self._keyring = keyring
        self._index = index
        self._pages = pages
        self._kv = kv
        self._server_id = server_id
        self._membership = membership
        self._ack_timeout_s = ack_timeout_s
        self._on_tenant_erased = on_tenant_erased
        self._on_user_erased = on_user_erased  # after a local erasure (retention forgets the user)
        self._wal = WalScrubber(db)
        self._one_per_user = _OneErasurePerUser()

    def holds_user(self, user: UserId) -> bool:
        """Whether anything of `user` is stored: a session, a stored response, or a data key of
        its tenant (KV it wrote). API keys are the API's (`ApiKeys.holds_user`)."""
        return self._versions.holds_user(user) or self._keyring.holds_key(self._identity.tenant_for(user))

    def erase_user(self, user: UserId) -> ErasureReceipt:
        """`_erase(user, if_held=False)`: always a receipt, even of nothing (the operator's)."""
        receipt = self._erase(user, if_held=False)
        assert receipt is not None  # only `if_held` erasures end without one
        return receipt

    def erase_if_held(self, user: UserId) -> ErasureReceipt | None:
        """`_erase(user, if_held=True)`: None when the server held nothing of `user` (no receipt)."""
        return self._erase(user, if_held=True)

    def _erase(self, user: UserId, if_held: bool) -> ErasureReceipt | None:
        """Erase `user` everywhere; the returned receipt counts this server's copies and, in a
        fleet, every other server's (those that acknowledged within `ack_timeout_s`).

        Erasures of one user run one at a time (in this process, and across the fleet through a
        PostgreSQL advisory lock held by the erasure's transaction), so each one reads the epoch
        the one before it left and erases the tenant of that epoch. With it go the user's
        earlier tenants that are not retired yet (none, unless an erasure failed, or ran before
        erasures were serialised): every tenant the user ever had ends retired, keyless, empty.

        Writes of the user racing the erasure are ordered by the write fence (the user's epoch
        row, `Identity.fence_in`), which the transaction locks first: they committed before it
        (and are deleted by it) or run after it in the new epoch; `erased_at` is taken after
        that lock, so "created before the erasure" means exactly the rows it deleted.

        The remote tier's keys of the tenant are deleted after the commit (`counts["remote_keys"]`,
        or "unavailable" when Redis does not answer): whatever is left there is unreadable, since
        the tenant's data key is destroyed in the transaction, and `verify` reports it.

        `if_held`: when the transaction finds nothing of the user (no session, stored response,
        page row, data key, audit entry naming it, nor page in this server's tiers), it writes no
        receipt and returns None: a receipt is permanent (the append-only chain), and erasing ids
        that hold nothing must not grow it. It still moves the user's epoch (its row created if
        missing: one keyed hash, as the user's first write would make), so that a write of the
        user admitted before it but not committed yet (a first turn being prepared) is refused as
        for any erasure; the retired tenant, named by no receipt, is erased again by the user's
        next erasure (`_never_erased`), finding nothing. Never in a fleet: another server may
        hold pages of the tenant in its memory that no row shows, and only a receipt reaches it."""
        self._kv.ensure_open()
        subject = self._identity.subject_hash(user)
        with self._one_per_user.holding(subject), self._sf() as s:
            if s.get_bind().dialect.name == "postgresql":
                # Held until this transaction ends: another server's erasure of the user waits.
                key = int(subject[:8], 16) - (1 << 31)  # 32 bits of the subject hash, as a signed int4
                s.execute(
                    text("SELECT pg_advisory_xact_lock(CAST(:c AS integer), CAST(:k AS integer))"),
                    {"c": _USER_LOCK_CLASS, "k": key},
                )
            epoch = self._identity.stored_epoch_in(s, user)
            tenants = self._identity.tenants_of(user, through=epoch)
            tenant = tenants[-1]
            if PUBLIC_TENANT in tenants:  # cannot happen (an HMAC is hex), but never erase shared pages
                raise ValueError("refusing to erase the public tenant")
            doomed = [*_never_erased(s, tenants[:-1]), tenant]
            with ExitStack() as erasing:
                for t in doomed:
                    erasing.enter_context(self._kv.saves.erasing(t))
                # From here the tenants get no data key: nothing of them is written or read again.
                for t in doomed:
                    self._keyring.retire(t)
                try:
                    usage, detached = self._detach_tenants(doomed)
                except BaseException:
                    for t in doomed:
                        self._keyring.unretire(t)
                    raise
                rid = "era_" + uuid.uuid4().hex[:24]
                try:
                    # First in the transaction: the epoch row, locked (the write fence).
                    new_epoch = self._identity.next_epoch_in(s, user, expected=epoch)
                    erased_at = datetime.now(UTC)
                    counts = _delete_rows(s, user, doomed, self._versions, self._keyring, usage)
                    # The admin audit trail names users by id (a key created for them): those
                    # entries now name the erased tenant instead, the receipt's subject.
                    counts["audit_entries"] = pseudonymise_audit(s, user, erased_pseudonym(tenant))
                    if if_held and self._membership is None and not _held_any(counts):
                        s.commit()  # the epoch's move alone
                        self._identity.forget(user)
                        return None
                    # The user's next tenant: a re-created user starts cold everywhere.
                    counts["epoch"] = new_epoch
                    seq, prev, entry = _append_receipt(s, rid, erased_at, tenant, counts, subject)
                    if self._membership is not None:
                        alive = self._membership.alive_in(s)
                        record_erasure_in(s, rid, self._server_id, alive, _local_counts(usage))
                    s.commit()
                except BaseException:
                    s.rollback()
                    self._pages.copies.abandon(detached)  # nothing was erased; recovery finds the files
                    for t in doomed:
                        self._keyring.unretire(t)
                    raise
                self._identity.forget(user)
                # Committed: now the irreversible part.
                for t in doomed:
                    self._keyring.forget_cached(t)
                self._pages.copies.destroy(detached, rows_deleted=True)
        out = dict(counts)
        remote_keys = self._erase_remote_all(doomed)
        fleet: FleetReport | None = None
        if remote_keys is not None:
            out["remote_keys"] = remote_keys
        if self._membership is not None:
            if remote_keys is not None:
                own = {**_local_counts(usage), "remote_keys": remote_keys}
                update_own_counts(self._sf, rid, self._server_id, own)
            fleet = wait_for_acks(self._sf, rid, self._ack_timeout_s)
            # The other servers' writers may have sent pages of the tenant to the remote tier
            # until they applied the erasure (each also empties it then): a second pass here.
            self._erase_remote_all(doomed)
            if fleet is not None and fleet.unanswered:
                log.warning(
                    "erasure %s: no acknowledgement in time from %s", rid, ", ".join(fleet.unanswered)
                )
        scrubbed = self._wal.scrub()
        if self._on_user_erased is not None:
            self._on_user_erased(user)
        return ErasureReceipt(rid, seq, erased_at, tenant, out, prev, entry, scrubbed, fleet)

    def _detach_tenants(self, tenants: list[TenantId]) -> tuple[dict[Tier, tuple[int, int]], list[PageEntry]]:
        """`_detach_tenant` of each, with what they held added up per tier."""
        usage = {t: (0, 0) for t in Tier}
        detached: list[PageEntry] = []
        for tenant in tenants:
            held, entries = self._detach_tenant(tenant)
            usage = {t: (usage[t][0] + held[t][0], usage[t][1] + held[t][1]) for t in Tier}
            detached.extend(entries)
        return usage, detached

    def _detach_tenant(self, tenant: TenantId) -> tuple[dict[Tier, tuple[int, int]], list[PageEntry]]:
        """Inside `erasing(tenant)`: the tenant's pages out of the page table and the index at once
        (no reader can have them from now on), once the moves of them in flight (the writer, a
        promotion) have settled and deleted their own copies. Returns what was held per tier and
        the detached entries, whose copies the caller destroys (after its commit, if any)."""
        usage = self._pages.tenant_usage(tenant)
        detached, gone = self._pages.copies.detach(self._pages.table.pages_of_tenant(tenant))
        self._index.drop_tenant(tenant)
        mine = {e.meta.hash for e in detached}
        if not self._pages.table.wait_settled([h for h in gone if h not in mine], _SETTLE_S):
            log.warning("erasure: some pages of a tenant were still being moved after %ss", _SETTLE_S)
        return usage, detached

    def _erase_remote_all(self, tenants: list[TenantId]) -> int | str | None:
        """`_erase_remote` of each tenant: the keys deleted in all, "unavailable" when the remote
        tier did not answer for one of them, None without a remote tier."""
        found = [self._erase_remote(t) for t in tenants]
        if any(isinstance(n, str) for n in found):
            return "unavailable"
        counted = [n for n in found if isinstance(n, int)]
        return sum(counted) if counted else None

    def _erase_remote(self, tenant: TenantId) -> int | str | None:
        """Delete the tenant's keys in the remote tier (None: there is none)."""
        remote = self._pages.remote
        if remote is None:
            return None
        try:
            return remote.erase_tenant(tenant)
        except TierUnavailable as exc:
            log.warning("erasure: the remote tier did not answer (%s); its copies are unreadable", exc)
            return "unavailable"

    def apply_fleet_erasure(self, receipt: PendingReceipt) -> LocalErasure:
        """Another server erased `receipt.tenant`: drop this server's copies (the rows and the data
        key are gone already, with the other server's transaction). Same order as `erase_user`:
        refuse saves, retire, out of the table and the index, let moves settle, then zero and
        unlink. Every cached erasure epoch is forgotten (this server does not know which user
        the tenant was), so that user's next `tenant_for`, and engine cache salt, is the new one.
        Idempotent: applying a receipt again finds nothing left."""
        tenant = receipt.tenant
        if tenant == PUBLIC_TENANT:
            raise ValueError("refusing to erase the public tenant")
        if self._on_tenant_erased is not None:
            try:
                self._on_tenant_erased(tenant)
            except Exception:
                log.exception("erasure %s: stopping the tenant's generations failed", receipt.id)
        with self._kv.saves.erasing(tenant):
            if receipt.retires:
                self._keyring.retire(tenant)
            usage, detached = self._detach_tenant(tenant)
            self._identity.forget_all()
            self._keyring.forget_cached(tenant)
            # Rows too (not `rows_deleted`): the erasing server deleted them, but a write-back
            # here may have recorded one after its commit.
            self._pages.copies.destroy(detached)
            # Until now this server did not know the tenant was erased: a data key it created
            # meanwhile (a first request here) and what its writer sent to the remote tier after
            # the erasing server emptied it go too.
            with transaction(self._sf) as s:
                self._keyring.destroy_in(s, tenant)
            remote_keys = self._erase_remote(tenant)
        counts = _local_counts(usage)
        if remote_keys is not None:
            counts["remote_keys"] = remote_keys
        try:
            left = len(_local_remnants(self._pages, tenant, float("inf")))
        except TierUnavailable:  # an unreadable disk must not stop the catch-up: ack, say unknown
            left = -1
        return LocalErasure(counts, left)

    def get_receipt(self, receipt_id: str) -> ErasureReceipt:
        return get_receipt(self._sf, receipt_id)

    def list_receipts(self, limit: int, after: str | None = None) -> tuple[list[ErasureReceipt], bool]:
        return list_receipts(self._sf, limit, after)

    def verify(self, receipt_id: str, full: bool = False) -> Verification:
        """`full`: the audit (the chain from its start, every page file's header), O(all data)."""
        return verify(self._sf, self._wal, self._identity, self._pages, receipt_id, full)


def _user_rows_left(s: Session, identity: Identity, receipt: ErasureReceipt, tenant: TenantId) -> list[str]:
    """The erased user's sessions and stored responses created before the erasure (after it,
    they belong to the user's next epoch). Found by the user's subject hash, which the receipt
    and every row written since migration 0013 carry: indexed lookups, whatever the number of
    users. Rows without one (older) are matched the old way, by hashing their owners' ids
    (`Identity.users_having`): only theirs, or every user's for a receipt without a subject."""
    user_subject = s.scalar(
        select(m.ErasureReceiptRow.user_subject).where(m.ErasureReceiptRow.id == receipt.id)
    )
    details = []
    for what, table in (("session", m.SessionRow), ("stored response", m.ResponseRow)):
        before = table.created_at <= receipt.erased_at
        old = 0
        if user_subject is not None:
            old += s.execute(
                select(func.count()).select_from(table).where(table.subject == user_subject, before)
            ).scalar_one()
        # The rows the lookup above cannot find: those without a subject (all, without one).
        unmarked = [] if user_subject is None else [table.subject.is_(None)]
        users = [UserId(u) for u in s.execute(select(table.user_id).where(*unmarked).distinct()).scalars()]
        mine = identity.users_having(tenant, users) if users else []
        if mine:
            old += s.execute(
                select(func.count()).select_from(table).where(table.user_id.in_(mine), before, *unmarked)
            ).scalar_one()
        if old:
            details.append(f"database: {old} {what}(s) created before the erasure")
    return details


def _local_counts(usage: dict[Tier, tuple[int, int]]) -> dict[str, Any]:
    """One server's copies of a tenant, per tier: what its acknowledgement reports."""
    return {"pages": {t.value: usage[t][0] for t in Tier}, "bytes": {t.value: usage[t][1] for t in Tier}}


def _local_remnants(pages: TieredPages, tenant: TenantId, cutoff_ts: float, full: bool = False) -> list[str]:
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


def _never_erased(s: Session, tenants: list[TenantId]) -> list[TenantId]:
    """Those of `tenants` no receipt names: none, unless an erasure ran before erasures of
    a user were serialised. (A tenant a receipt names is erased, and retired, by the erasure
    that wrote it, and on every other server of the fleet by its follower.)"""
    if not tenants:
        return []
    named = set(
        s.scalars(select(m.ErasureReceiptRow.subject).where(m.ErasureReceiptRow.subject.in_(tenants)))
    )
    return [t for t in tenants if t not in named]


def erased_pseudonym(tenant: TenantId) -> str:
    """What the audit trail names an erased user by: the tenant its erasure retired (a keyed hash
    of the id and the epoch, the receipt's `subject`), never the id."""
    return f"erased:{tenant}"


def _replaced(value: Any, user: str, pseudonym: str) -> Any:
    """`value` (JSON) with every string equal to `user` replaced by `pseudonym`."""
    if isinstance(value, str):
        return pseudonym if value == user else value
    if isinstance(value, list):
        return [_replaced(v, user, pseudonym) for v in value]
    if isinstance(value, dict):
        return {k: _replaced(v, user, pseudonym) for k, v in value.items()}
    return value


def pseudonymise_audit(s: Session, user: UserId, pseudonym: str) -> int:
    """In the caller's transaction: the admin audit entries whose detail names `user` (`"user"`:
    the user a key was created for) name `pseudonym` instead; returns how many. The trail is
    otherwise never changed; this keeps who did what to which key, not to whom. Idempotent.
    Reads the entries that name the user (the trail is as long as the admin operations)."""
    rows = s.scalars(select(m.AdminAuditRow).where(m.AdminAuditRow.detail["user"].as_string() == user))
    n = 0
    for row in rows:
        row.detail = _replaced(dict(row.detail), user, pseudonym)
        n += 1
    s.flush()
    return n


def _held_any(counts: dict[str, Any]) -> bool:
    """Whether `_delete_rows`'s counts found anything of the user (rows, a data key, pages, audit
    entries naming the user)."""
    rows = (
        "sessions",
        "versions",
        "branches",
        "responses",
        "page_rows",
        "data_keys_destroyed",
        "audit_entries",
    )
    return any(counts[k] for k in rows) or any(counts["pages"].values())


def _delete_rows(
    s: Session,
    user: UserId,
    tenants: list[TenantId],
    versions: VersionStore,
    keyring: Keyring,
    usage: dict[Tier, tuple[int, int]],
) -> dict[str, Any]:
    dialogue = versions.delete_user_sessions(user, s)
    n_page_rows = cast(
        CursorResult[Any], s.execute(delete(m.PageRow).where(m.PageRow.tenant.in_(tenants)))
    ).rowcount
    n_keys = sum(keyring.destroy_in(s, t) for t in tenants)
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
    last = s.execute(select(m.ErasureReceiptRow).order_by(m.ErasureReceiptRow.seq.desc()).limit(1)).scalar()
    seq = (last.seq + 1) if last else 1
    prev = last.entry_hash if last else GENESIS
    entry = entry_hash(prev, rid, seq, erased_at, subject, counts)
    s.add(
        m.ErasureReceiptRow(
            id=rid,
            seq=seq,
            erased_at=erased_at,
            subject=subject,
            counts=counts,
            prev_hash=prev,
            entry_hash=entry,
            user_subject=user_subject,
        )
    )
    s.flush()
    return seq, prev, entry


def get_receipt(sf: sessionmaker[Session], receipt_id: str) -> ErasureReceipt:
    with sf() as s:
        row = s.get(m.ErasureReceiptRow, receipt_id)
        if row is None:
            raise ReceiptNotFound(f"no erasure receipt {receipt_id!r}")
    return _receipt(row, fleet_report(sf, receipt_id))


def list_receipts(
    sf: sessionmaker[Session], limit: int, after: str | None = None
) -> tuple[list[ErasureReceipt], bool]:
    """Receipts newest first (by chain position), `limit` of them after the receipt `after`;
    and whether more follow. The fleet sections are left out (`get_receipt` has them)."""
    with sf() as s:
        q = select(m.ErasureReceiptRow).order_by(m.ErasureReceiptRow.seq.desc()).limit(limit + 1)
        if after is not None:
            cursor = s.get(m.ErasureReceiptRow, after)
            if cursor is None:
                raise ReceiptNotFound(f"no erasure receipt {after!r}")
            q = q.where(m.ErasureReceiptRow.seq < cursor.seq)
        rows = list(s.scalars(q))
    return [_receipt(r) for r in rows[:limit]], len(rows) > limit


def verify(
    sf: sessionmaker[Session],
    wal: WalScrubber,
    identity: Identity,
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
    with sf() as s:
        details.extend(_user_rows_left(s, identity, receipt, tenant))
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
    chain = check_chain(sf, identity, receipt.seq, full=full)
    if chain.problem is not None:
        details.append(chain.problem)
    details.extend(_local_remnants(pages, tenant, cutoff_ts, full=full))
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
