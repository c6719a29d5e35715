"""Erasing a user (GDPR/CCPA) and proving it.

Order matters. First the user's pages leave the page table and the index (no reader can have
them any more) while saves of the user are refused (`KVCache.saves.erasing`) and moves in flight
settle; then the database transaction (sessions, versions, stored responses, page rows, the
data key, the user's id in the admin audit trail replaced by a pseudonym, and the receipt)
commits; then the irreversible steps run (zeroing host slots, unlinking files).
Destroying the data key is what makes any copy of the user's pages that we cannot reach (a
backup) unreadable. Public-prefix pages are not user data and stay.

Receipts (`dss.ops.erasure.receipts`) form an append-only hash chain; `verify`
(`dss.ops.erasure.verify`) re-scans the database and every tier for anything of the subject
older than the erasure, and checks the chain up to the receipt.

Every table is changed by its owner (`dss.db.models.TABLE_OWNERS`), inside this one transaction: the
dialogue's rows by `VersionStore.delete_user_sessions`, the page rows by `dss.pages.rows`, the data
keys by `Keyring.destroy_in`, the epoch by `Identity`, the receipt by `dss.db.receipt_rows`, and the
API's audit trail by what the API passes in (`pseudonymise_audit_in`).

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
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import transaction
from dss.dialogue.versions import VersionStore
from dss.errors import TierUnavailable
from dss.fleet.erasures import (
    FleetReport,
    LocalErasure,
    PendingReceipt,
    record_erasure_in,
    update_own_counts,
    wait_for_acks,
)
from dss.fleet.members import Membership
from dss.index.prefix_index import PrefixIndex
from dss.keys.identity import Identity
from dss.keys.keyring import Keyring
from dss.ops.erasure.receipts import (
    ErasureReceipt,
    append_receipt,
    erased_pseudonym,
    get_receipt,
    list_receipts,
    never_erased,
)
from dss.ops.erasure.verify import Verification, local_remnants, verify
from dss.ops.erasure.wal_scrub import WalScrubber
from dss.ops.kv import KVCache
from dss.pages.placement import TieredPages
from dss.pages.rows import delete_tenants_in
from dss.pages.table import PageEntry
from dss.types import PUBLIC_TENANT, TenantId, Tier, UserId

log = logging.getLogger("dss.erasure")
_SETTLE_S = 30.0

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


OnTenantErased = Callable[[TenantId], None]
PseudonymiseIn = Callable[[Session, UserId, str], int]
"""In the erasure's transaction: the entries of a table outside `dss` (the API's admin audit
trail) that name the user now name the pseudonym instead; returns how many."""


class Eraser:
    """Erases users and verifies erasures, over the parts that hold their data.

    `membership` is None for a single server (SQLite): no acknowledgements, no notification, and
    `erase_user` does not wait for anyone. `on_tenant_erased` is called when another server's
    erasure is applied here, before this server's copies are dropped (the API stops the tenant's
    running generations with it); it runs on the fleet follower thread, with no lock held.
    `pseudonymise_audit_in`: the API's (its audit trail is its own table); None, no audit trail.
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
        pseudonymise_audit_in: PseudonymiseIn | None = None,
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
        self._pseudonymise_audit_in = pseudonymise_audit_in
        self._wal = WalScrubber(db)
        self._one_per_user = _OneErasurePerUser()

    def scrub_at_open(self) -> bool | None:
        """Scrub SQLite's WAL once, waiting, while nothing else of the store uses the database
        yet (`Store` calls it before its threads start): the receipts of earlier runs are then
        known to be scrubbed. False (and logged) when another process's reader kept it from
        finishing; None when not SQLite."""
        return self._wal.scrub()

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
            doomed = [*never_erased(s, tenants[:-1]), tenant]
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
                    pseudonymise = self._pseudonymise_audit_in
                    audit = pseudonymise(s, user, erased_pseudonym(tenant)) if pseudonymise is not None else 0
                    counts["audit_entries"] = audit
                    if if_held and self._membership is None and not _held_any(counts):
                        s.commit()  # the epoch's move alone
                        self._identity.forget(user)
                        return None
                    # The user's next tenant: a re-created user starts cold everywhere.
                    counts["epoch"] = new_epoch
                    seq, prev, entry = append_receipt(s, rid, erased_at, tenant, counts, subject)
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
            left = len(local_remnants(self._pages, tenant, float("inf")))
        except TierUnavailable:  # an unreadable disk must not stop the catch-up: ack, say unknown
            left = -1
        return LocalErasure(counts, left)

    def get_receipt(self, receipt_id: str) -> ErasureReceipt:
        return get_receipt(self._sf, receipt_id)

    def list_receipts(self, limit: int, after: str | None = None) -> tuple[list[ErasureReceipt], bool]:
        return list_receipts(self._sf, limit, after)

    def verify(self, receipt_id: str, full: bool = False) -> Verification:
        """`full`: the audit (the chain from its start, every page file's header), O(all data)."""
        return verify(self._sf, self._wal, self._identity, self._keyring, self._pages, receipt_id, full)


def _local_counts(usage: dict[Tier, tuple[int, int]]) -> dict[str, Any]:
    """One server's copies of a tenant, per tier: what its acknowledgement reports."""
    return {"pages": {t.value: usage[t][0] for t in Tier}, "bytes": {t.value: usage[t][1] for t in Tier}}


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
    n_page_rows = delete_tenants_in(s, tenants)
    n_keys = sum(keyring.destroy_in(s, t) for t in tenants)
    return {
        "sessions": dialogue["sessions"],
        "versions": dialogue["versions"],
        "branches": dialogue["branches"],
        "responses": dialogue["responses"],
        "page_rows": n_page_rows,
        "data_keys_destroyed": n_keys,
        "pages": {t.value: usage[t][0] for t in Tier},
        "bytes": {t.value: usage[t][1] for t in Tier},
    }
