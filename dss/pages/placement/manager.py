"""The tier manager: `TieredPages`, what the rest of the store calls to move page bytes between tiers.

Policy across the tier backends (which know nothing of each other): promotion on hit (remote or
disk → host, `promotion`), write-behind of committed pages to the remote tier (Redis, shared by a
fleet; it is self-indexing, so its copies are not tracked here: a page the table lists as `REMOTE`
only is one a lookup found there, about to be promoted), eviction under pressure (host → disk
first: write-back, `host_room`; disk-only pages dropped, `disk_room`), write-through of committed
pages (called by `dss.ops.kv.writeback`, `writer`), pins for hot public prefixes, retention classes
and demotion on request (host → disk, for `dss.ops.retention`, `demotion`), and dropping pages
everywhere (eviction from the last tier, erasure, corruption, `copies`). `TieredPages` composes
those collaborators, each a public attribute a caller calls directly (`table`: presence, pins,
retention classes, validity; `promoter`, `demoter`; `copies`: drop, detach, destroy, abandon), and
keeps what spans several: the queries over tiers, the readers' leases, publishing, the invariant check.

Every move follows one pattern: claim the page in the `PageTable` (a short critical section),
copy / compress / encrypt / write / fsync with no lock held, then settle the result in another
short critical section. Every claim is settled whatever happens during the move (a failure is an
outcome, never an escaped exception with the page still claimed): a page left claimed would never
be evicted again. The table's lock is a leaf; the tier backends' locks are leaves too and are
never taken while the table's is held. So the lock order is simply: none is nested.

Nothing here knows about the index. A page that leaves every tier (evicted from the last one,
dropped as corrupt) is appended to the `gone` list the caller passes in; the caller unlinks it
from the index after the call returns. No callback runs upward.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from dss.pages.encoder import PageCodecProcess
from dss.pages.eviction import EvictionPolicy, PageStats
from dss.pages.meta import PageMeta
from dss.pages.placement.copies import PageCopies
from dss.pages.placement.counters import TierCounters
from dss.pages.placement.demotion import Demoter
from dss.pages.placement.disk_room import DiskRoom
from dss.pages.placement.host_room import HostRoom
from dss.pages.placement.promotion import Promoter
from dss.pages.placement.writer import DataKeyLookup, PageWriter
from dss.pages.rows import PageRows
from dss.pages.table import Held, PageEntry, PageTable
from dss.pages.tiers.disk import DiskTier
from dss.pages.tiers.host import HostTier
from dss.pages.tiers.remote import RemoteTier
from dss.types import PageHash, TenantId, Tier
from dss.wire import SlotRef


class TieredPages:
    def __init__(
        self,
        table: PageTable,
        host: HostTier,
        disk: DiskTier | None,
        policy: EvictionPolicy,
        rows: PageRows,
        data_key: DataKeyLookup,
        encoder: PageCodecProcess | None = None,
        remote: RemoteTier | None = None,
    ) -> None:
        self.table = table
        self.remote = remote
        self.host = host
        self.disk = disk
        self.policy = policy
        self.rows = rows
        self.encoder = encoder
        self.counters = TierCounters()
        self.copies = PageCopies(table, host, disk, rows, self.counters)
        disk_room = DiskRoom(table, disk, policy, self.copies, self.counters) if disk is not None else None
        self._writer = PageWriter(
            table, host, disk, remote, rows, data_key, encoder, disk_room, self.copies, self.counters
        )
        self._host_room = HostRoom(table, host, policy, self._writer, self.copies, self.counters)
        self.promoter = Promoter(
            table, host, disk, remote, data_key, encoder, self._host_room, self.copies, self.counters
        )
        self.demoter = Demoter(table, self._writer if disk is not None else None, self.copies, self.counters)

    # ------------------------------------------------------------------ queries
    def tiers_of(self, page: PageHash) -> frozenset[Tier]:
        e = self.table.get(page)
        return frozenset(e.tiers) if e is not None else frozenset()

    def fastest_tier(self, page: PageHash) -> Tier | None:
        tiers = self.tiers_of(page)
        return min(tiers, key=lambda t: t.rank) if tiers else None

    def used_bytes(self) -> dict[Tier, int]:
        return {
            Tier.HOST: self.host.used_bytes,
            Tier.DISK: self.disk.used_bytes if self.disk else 0,
            Tier.REMOTE: 0,  # shared by the fleet: `RemoteTier.stats()` reads it from Redis
        }

    def page_counts(self) -> dict[Tier, int]:
        counts = dict.fromkeys(Tier, 0)
        for e in self.table.snapshot():
            for t in e.tiers:
                counts[t] += 1
        return counts

    def tenant_usage(self, tenant: TenantId) -> dict[Tier, tuple[int, int]]:
        """{tier: (pages, bytes)} held for one tenant (disk bytes are bytes on disk)."""
        return _usage(self.table.snapshot(tenant))

    @property
    def disk_available(self) -> bool:
        return self.disk is not None and self.disk.available

    @property
    def remote_available(self) -> bool:
        return self.remote is not None and self.remote.available

    # ------------------------------------------------------------------ readers
    def lease_prefix(self, pages: Iterable[PageHash]) -> list[Held]:
        held = self.table.lease_prefix(pages)
        hits = sum(1 for h in held if h.host_ref is not None)
        if hits:
            self.counters.count("hits_pages", Tier.HOST, hits)
        return held

    def unlease(self, held: Iterable[Held]) -> None:
        for ref in self.table.unlease(held):  # slots of pages gone while these leases lasted
            self.host.release(ref)

    # ------------------------------------------------------------------ writing
    def reserve_host(self, nbytes: int, gone: list[PageHash]) -> SlotRef:
        """A free host slot for a page about to be written, evicting (and writing back) if needed."""
        return self._host_room.reserve(nbytes, gone)

    def release_host(self, ref: SlotRef) -> None:
        self.host.release(ref)

    def zero_host(self, ref: SlotRef) -> None:
        """Zero a reserved slot that stays reserved (its owner may still write into it; it is
        zeroed again when released)."""
        self.host.slot_array(ref).fill(0)

    def publish(self, meta: PageMeta, ref: SlotRef) -> bool:
        """Make a page written into a reserved host slot visible. False if it already existed
        (the slot is then freed)."""
        now = time.monotonic()
        stats = PageStats(last_access=now, hits=0, created=now, index=meta.index, nbytes=meta.nbytes)
        if self.table.insert(PageEntry(meta, stats, {Tier.HOST}, host_ref=ref)):
            return True
        self.host.release(ref)
        return False

    def add_remote_resident(self, meta: PageMeta) -> bool:
        """A page a lookup found in the remote tier (promoted next). False if already present."""
        now = time.monotonic()
        stats = PageStats(last_access=now, hits=0, created=now, index=meta.index, nbytes=meta.nbytes)
        return self.table.insert(PageEntry(meta, stats, {Tier.REMOTE}))

    def add_disk_resident(self, meta: PageMeta, disk_bytes: int) -> None:
        """Recovery: a page known only from the disk tier."""
        stats = PageStats(
            last_access=0.0, hits=0, created=time.monotonic(), index=meta.index, nbytes=meta.nbytes
        )
        self.table.insert(PageEntry(meta, stats, {Tier.DISK}, disk_bytes=disk_bytes))

    def write_to_disk(self, page: PageHash, gone: list[PageHash]) -> bool:
        """Write-through of one host page (`PageWriter.write_through`)."""
        return self._writer.write_through(page, gone)

    # ------------------------------------------------------------------ checks
    def check(self, reserved_elsewhere: Iterable[SlotRef] = ()) -> None:
        """Invariants at rest: every entry is in a tier and each tier agrees with the table.
        `reserved_elsewhere`: host slots reserved for saves not committed yet. Slots parked for
        leases (pages gone while a reader held them) are reserved too."""
        entries = self.table.snapshot()
        refs: set[SlotRef] = set()
        for e in entries:
            name = e.meta.hash.hex()[:16]
            if not e.tiers:
                raise AssertionError(f"page {name} is in no tier")
            if e.busy or e.leases < 0:
                raise AssertionError(f"page {name} is busy or has a negative lease count at rest")
            if (Tier.HOST in e.tiers) != (e.host_ref is not None):
                raise AssertionError(f"page {name}: host tier flag and slot disagree")
            if e.host_ref is not None:
                if e.host_ref in refs:
                    raise AssertionError(f"page {name} shares its host slot")
                refs.add(e.host_ref)
            if Tier.DISK in e.tiers and (self.disk is None or not self.disk.contains(e.meta.hash)):
                raise AssertionError(f"page {name} missing from disk tier")
        expected = refs | set(reserved_elsewhere) | set(self.table.parked_slots())
        actual = self.host.reserved_slots()
        if actual != expected:
            raise AssertionError(
                f"host slots disagree with the page table: {len(actual - expected)} untracked, "
                f"{len(expected - actual)} missing"
            )
        if self.disk is not None:
            self.disk.check()
            on_disk = {e.meta.hash for e in entries if Tier.DISK in e.tiers}
            for h in self.disk.keys():  # noqa: SIM118 - a tier, not a dict
                if h not in on_disk:
                    raise AssertionError(f"disk tier holds untracked page {h.hex()[:16]}")


def _usage(entries: Iterable[PageEntry]) -> dict[Tier, tuple[int, int]]:
    out: dict[Tier, tuple[int, int]] = dict.fromkeys(Tier, (0, 0))
    for e in entries:
        for t in e.tiers:
            n, b = out[t]
            out[t] = (n + 1, b + (e.disk_bytes if t is Tier.DISK else e.meta.nbytes))
    return out
