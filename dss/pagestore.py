"""The page table and the tier manager: where each page's bytes are, and moving them.

Owns policy across the tier backends (which know nothing of each other): promotion on hit
(disk → host), demotion under pressure (host → disk before a page is dropped: write-back),
asynchronous write-through of committed pages to disk, pins for pages in use and for hot public
prefixes, and dropping pages everywhere (eviction from the last tier, erasure).

Nothing here knows about the trie; the store is told through `on_dropped` when a page left
every tier, so that it can unlink the page from its index.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dss.errors import CapacityError, CorruptPage, KeyDestroyed, StorageError, TierUnavailable
from dss.eviction import EvictionPolicy, PageStats, choose_victims
from dss.pages import PageMeta
from dss.tiers.device import DeviceTier
from dss.tiers.disk import DiskTier
from dss.tiers.host import HostTier, SlotRef
from dss.types import PageHash, TenantId, Tier

log = logging.getLogger("dss.pagestore")

DataKeyLookup = Callable[[TenantId], bytes]
"""Returns the tenant's data key (creating it on first use); raises KeyDestroyed after an erasure."""


@dataclass(slots=True)
class PageEntry:
    meta: PageMeta
    stats: PageStats
    tiers: set[Tier] = field(default_factory=set)
    leases: int = 0  # loads or saves in flight: never evicted while > 0
    disk_bytes: int = 0
    created_wall: float = field(default_factory=time.time)  # compared with erasure times


@dataclass
class TierCounters:
    """Monotonic counters per tier, read by the metrics exporter."""

    hits_pages: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    promotions: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    evictions: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    corrupt_pages: int = 0
    disk_write_errors: int = 0
    pages_dropped: int = 0


class PageStore:
    def __init__(
        self,
        host: HostTier,
        disk: DiskTier | None,
        device: DeviceTier | None,
        policy: EvictionPolicy,
        data_key: DataKeyLookup,
        on_disk_written: Callable[[PageMeta, int], None],
        on_disk_deleted: Callable[[list[PageHash]], None],
        on_dropped: Callable[[list[PageHash]], None],
        write_through: bool = True,
    ) -> None:
        self.host = host
        self.disk = disk
        self.device = device
        self.policy = policy
        self._data_key = data_key
        self._on_disk_written = on_disk_written
        self._on_disk_deleted = on_disk_deleted
        self._on_dropped = on_dropped
        self.write_through = write_through
        self.entries: dict[PageHash, PageEntry] = {}
        self.counters = TierCounters()
        # RLock: eviction callbacks re-enter (drop → on_dropped → store → drop of descendants).
        self._lock = threading.RLock()
        self._write_queue: queue.Queue[PageHash | None] = queue.Queue()
        self._writer = threading.Thread(target=self._writer_loop, name="dss-disk-writer", daemon=True)
        self._writer.start()
        self._closed = False

    # ------------------------------------------------------------------ queries
    def contains(self, page: PageHash) -> bool:
        with self._lock:
            return page in self.entries

    def tiers_of(self, page: PageHash) -> frozenset[Tier]:
        with self._lock:
            e = self.entries.get(page)
            return frozenset(e.tiers) if e else frozenset()

    def fastest_tier(self, page: PageHash) -> Tier | None:
        tiers = self.tiers_of(page)
        return min(tiers, key=lambda t: t.rank) if tiers else None

    def used_bytes(self) -> dict[Tier, int]:
        out = {Tier.HOST: self.host.used_bytes, Tier.DISK: self.disk.used_bytes if self.disk else 0}
        out[Tier.DEVICE] = self.device.used_bytes if self.device else 0
        return out

    def page_counts(self) -> dict[Tier, int]:
        with self._lock:
            counts = dict.fromkeys(Tier, 0)
            for e in self.entries.values():
                for t in e.tiers:
                    counts[t] += 1
            return counts

    @property
    def disk_available(self) -> bool:
        return self.disk is not None and self.disk.available

    # ------------------------------------------------------------------ leases
    def lease(self, pages: Iterable[PageHash]) -> None:
        with self._lock:
            for p in pages:
                self.entries[p].leases += 1

    def unlease(self, pages: Iterable[PageHash]) -> None:
        with self._lock:
            for p in pages:
                e = self.entries.get(p)
                if e is not None and e.leases > 0:
                    e.leases -= 1

    def set_pinned(self, pages: Iterable[PageHash], pinned: bool) -> int:
        n = 0
        with self._lock:
            for p in pages:
                e = self.entries.get(p)
                if e is not None:
                    e.stats.pinned = pinned
                    n += 1
        return n

    def touch(self, pages: Iterable[PageHash]) -> None:
        now = time.monotonic()
        with self._lock:
            for p in pages:
                e = self.entries.get(p)
                if e is not None:
                    e.stats.last_access = now
                    e.stats.hits += 1

    # ------------------------------------------------------------------ writing
    def reserve_host(self, nbytes: int) -> SlotRef:
        """A free host slot for a page the engine is about to write (evicting if needed)."""
        with self._lock:
            try:
                return self.host.reserve(nbytes)
            except CapacityError:
                self._make_room_host(nbytes)
                return self.host.reserve(nbytes)

    def release_host(self, ref: SlotRef) -> None:
        self.host.release(ref)

    def publish(self, meta: PageMeta, ref: SlotRef) -> bool:
        """Make a page written into a reserved host slot visible. False if it already existed."""
        with self._lock:
            if meta.hash in self.entries:
                self.host.release(ref)
                return False
            self.host.publish(meta.hash, ref)
            now = time.monotonic()
            stats = PageStats(
                last_access=now, hits=0, created=now, index=meta.index, nbytes=meta.nbytes, pinned=False
            )
            self.entries[meta.hash] = PageEntry(meta=meta, stats=stats, tiers={Tier.HOST})
        if self.write_through and self.disk is not None:
            self._write_queue.put(meta.hash)
        return True

    def put(self, meta: PageMeta, data: bytes | memoryview) -> bool:
        """Store page bytes given in memory (tests, tools); same path as an engine save."""
        ref = self.reserve_host(meta.nbytes)
        try:
            self.host.arena_view(ref)[:] = data
        except Exception:
            self.host.release(ref)
            raise
        return self.publish(meta, ref)

    def add_disk_resident(self, meta: PageMeta, disk_bytes: int) -> None:
        """Recovery: a page known only from the disk tier."""
        now = time.monotonic()
        stats = PageStats(
            last_access=0.0, hits=0, created=now, index=meta.index, nbytes=meta.nbytes, pinned=False
        )
        with self._lock:
            self.entries[meta.hash] = PageEntry(
                meta=meta, stats=stats, tiers={Tier.DISK}, disk_bytes=disk_bytes
            )

    def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until the write-through queue is drained (tests, clean shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._write_queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    # ------------------------------------------------------------------ reading
    def host_slot(self, page: PageHash) -> SlotRef | None:
        with self._lock:
            e = self.entries.get(page)
            if e is None or Tier.HOST not in e.tiers:
                return None
            self.counters.hits_pages[Tier.HOST] += 1
            return self.host.slot_of(page)

    def promote_to_host(self, page: PageHash) -> SlotRef | None:
        """Bring a page into the host arena (from disk if needed). None when it cannot be had:
        unknown, corrupt (then deleted and counted), key destroyed, the disk tier failed, or no
        host room (everything leased)."""
        with self._lock:
            e = self.entries.get(page)
            if e is None:
                return None
            if Tier.HOST in e.tiers:
                return self.host.slot_of(page)
            if Tier.DISK not in e.tiers or self.disk is None:
                return None
            e.leases += 1  # keep it from being dropped while we read outside the lock
            meta = e.meta
            try:
                ref = self.reserve_host(meta.nbytes)
            except CapacityError:
                e.leases -= 1
                return None
        published = False
        try:
            key = self._data_key(meta.tenant)
            # decode straight into the reserved slot: no intermediate copy
            self.disk.read(page, key, out=self.host.slot_array(ref))
            with self._lock:
                if page in self.entries:  # not erased while we were reading
                    self.host.publish(page, ref)
                    e.tiers.add(Tier.HOST)
                    self.counters.promotions[Tier.HOST] += 1
                    self.counters.hits_pages[Tier.DISK] += 1
                    published = True
            return ref if published else None
        except (CorruptPage, KeyDestroyed) as exc:
            log.warning("page %s unreadable on disk (%s); dropped, will be recomputed", page.hex()[:16], exc)
            with self._lock:
                self.counters.corrupt_pages += 1
            self.drop([page])
            return None
        except (StorageError, OSError) as exc:  # tier unavailable, page file gone
            log.warning("disk tier read failed for %s: %s", page.hex()[:16], exc)
            return None
        finally:
            with self._lock:
                e.leases = max(0, e.leases - 1)
                if not published:
                    self.host.release(ref)

    def promote_to_device(self, page: PageHash) -> Any | None:
        """The page as a tensor in the device tier (a hot page about to be copied into engine
        blocks on the same device). None when there is no device tier or the page cannot be had."""
        if self.device is None:
            return None
        with self._lock:
            e = self.entries.get(page)
            if e is None:
                return None
            if Tier.DEVICE in e.tiers:
                e.stats.hits += 1
                self.counters.hits_pages[Tier.DEVICE] += 1
                return self.device.get(page)
        if self.promote_to_host(page) is None:
            return None
        with self._lock:
            if page not in self.entries or Tier.HOST not in e.tiers:
                return None
            try:
                try:
                    self.device.put(page, self.host.get(page))
                except CapacityError:
                    self._make_room_device(e.meta.nbytes)
                    self.device.put(page, self.host.get(page))
            except CapacityError:
                return None
            e.tiers.add(Tier.DEVICE)
            self.counters.promotions[Tier.DEVICE] += 1
            return self.device.get(page)

    def _make_room_device(self, nbytes: int) -> None:
        """Demote device pages to the host tier (copying down first when only the device has it)."""
        assert self.device is not None
        need = nbytes - (self.device.capacity_bytes - self.device.used_bytes)
        if need <= 0:
            return
        candidates = [
            (h, e.stats) for h, e in self.entries.items() if Tier.DEVICE in e.tiers and e.leases == 0
        ]
        for h in choose_victims(candidates, self.policy, time.monotonic(), need):
            e = self.entries[h]
            if Tier.HOST not in e.tiers:
                ref = self.reserve_host(e.meta.nbytes)
                self.host.arena_view(ref)[:] = self.device.get(h).cpu().numpy().tobytes()
                self.host.publish(h, ref)
                e.tiers.add(Tier.HOST)
            self.device.delete(h)
            e.tiers.discard(Tier.DEVICE)
            self.counters.evictions[Tier.DEVICE] += 1

    def read_bytes(self, page: PageHash) -> bytes | None:
        """A copy of the page bytes from the fastest tier (tests, tools, verification)."""
        ref = self.promote_to_host(page)
        if ref is None:
            return None
        with self._lock:
            if page not in self.entries:
                return None
            return bytes(self.host.arena_view(ref))

    # ------------------------------------------------------------------ eviction
    def _make_room_host(self, nbytes: int) -> None:
        """Demote host pages (writing back to disk first) until `nbytes` fit."""
        need = nbytes - self.host.free_bytes
        if need <= 0:
            return
        now = time.monotonic()
        candidates = [(h, e.stats) for h, e in self.entries.items() if Tier.HOST in e.tiers and e.leases == 0]
        victims = choose_victims(candidates, self.policy, now, need)
        if not victims:
            raise CapacityError("host tier is full of pages in use or pinned")
        dropped: list[PageHash] = []
        for h in victims:
            e = self.entries[h]
            if Tier.DISK not in e.tiers and not self._write_to_disk(h):
                dropped.append(h)
                continue
            self.host.delete(h)
            e.tiers.discard(Tier.HOST)
            self.counters.evictions[Tier.HOST] += 1
        if dropped:
            self.drop(dropped)

    def _make_room_disk(self, nbytes: int) -> None:
        assert self.disk is not None
        need = nbytes - (self.disk.capacity_bytes - self.disk.used_bytes)
        if need <= 0:
            return
        now = time.monotonic()
        candidates = [
            (h, e.stats) for h, e in self.entries.items() if e.tiers == {Tier.DISK} and e.leases == 0
        ]
        victims = choose_victims(candidates, self.policy, now, need)
        if not victims:
            raise CapacityError("disk tier is full of pages in use or pinned")
        self.counters.evictions[Tier.DISK] += len(victims)
        self.drop(victims)

    def _write_to_disk(self, page: PageHash) -> bool:
        """Encrypt, compress and write one host-resident page. Call with the lock held."""
        if self.disk is None or not self.disk.available:
            return False
        e = self.entries.get(page)
        if e is None or Tier.DISK in e.tiers:
            return e is not None
        if Tier.HOST not in e.tiers:
            return False
        try:
            key = self._data_key(e.meta.tenant)
        except KeyDestroyed:
            return False
        raw = self.host.get(page)
        try:
            try:
                written = self.disk.write(e.meta, raw, key)
            except CapacityError:
                self._make_room_disk(e.meta.nbytes)
                written = self.disk.write(e.meta, raw, key)
        except (TierUnavailable, CapacityError) as exc:
            self.counters.disk_write_errors += 1
            log.error("disk tier unavailable, serving from memory only: %s", exc)
            return False
        e.tiers.add(Tier.DISK)
        e.disk_bytes = written
        self._on_disk_written(e.meta, written)
        return True

    def _writer_loop(self) -> None:
        while True:
            page = self._write_queue.get()
            try:
                if page is None:
                    return
                with self._lock:
                    self._write_to_disk(page)
            except Exception:  # the writer must survive anything; the page stays in memory
                log.exception("write-through of a page failed")
            finally:
                self._write_queue.task_done()

    # ------------------------------------------------------------------ dropping
    def drop(self, pages: Iterable[PageHash], notify: bool = True) -> dict[Tier, tuple[int, int]]:
        """Remove pages from every tier. Returns {tier: (pages, bytes)} removed.

        Irreversible steps (unlinking files, zeroing slots) happen after the page table is
        updated; the caller has already committed any metadata change."""
        removed: dict[Tier, tuple[int, int]] = dict.fromkeys(Tier, (0, 0))
        gone: list[PageHash] = []
        disk_gone: list[PageHash] = []
        with self._lock:
            for h in pages:
                e = self.entries.pop(h, None)
                if e is None:
                    continue
                gone.append(h)
                for tier in list(e.tiers):
                    freed = self._delete_from(tier, h)
                    n, b = removed[tier]
                    removed[tier] = (n + 1, b + freed)
                    if tier is Tier.DISK:
                        disk_gone.append(h)
            self.counters.pages_dropped += len(gone)
        if disk_gone:
            self._on_disk_deleted(disk_gone)
        if notify and gone:
            self._on_dropped(gone)
        return removed

    def _delete_from(self, tier: Tier, page: PageHash) -> int:
        if tier is Tier.HOST:
            return self.host.delete(page)
        if tier is Tier.DISK and self.disk is not None:
            return self.disk.delete(page)
        if tier is Tier.DEVICE and self.device is not None:
            return self.device.delete(page)
        return 0

    def pages_of_tenant(self, tenant: TenantId) -> list[PageHash]:
        with self._lock:
            return [h for h, e in self.entries.items() if e.meta.tenant == tenant]

    def tenant_usage(self, tenant: TenantId) -> dict[Tier, tuple[int, int]]:
        """{tier: (pages, bytes)} held for one tenant (disk bytes are bytes on disk)."""
        out: dict[Tier, tuple[int, int]] = dict.fromkeys(Tier, (0, 0))
        with self._lock:
            for e in self.entries.values():
                if e.meta.tenant != tenant:
                    continue
                for t in e.tiers:
                    n, b = out[t]
                    out[t] = (n + 1, b + (e.disk_bytes if t is Tier.DISK else e.meta.nbytes))
        return out

    def entries_of_tenant(self, tenant: TenantId) -> list[PageEntry]:
        with self._lock:
            return [e for e in self.entries.values() if e.meta.tenant == tenant]

    # ------------------------------------------------------------------ lifecycle
    def check(self) -> None:
        """Invariants: every entry is in at least one tier and each tier agrees with the table."""
        with self._lock:
            for h, e in self.entries.items():
                if not e.tiers:
                    raise AssertionError(f"page {h.hex()[:16]} is in no tier")
                if Tier.HOST in e.tiers and not self.host.contains(h):
                    raise AssertionError(f"page {h.hex()[:16]} missing from host tier")
                if Tier.DEVICE in e.tiers and (self.device is None or not self.device.contains(h)):
                    raise AssertionError(f"page {h.hex()[:16]} missing from device tier")
                if Tier.DISK in e.tiers and (self.disk is None or not self.disk.contains(h)):
                    raise AssertionError(f"page {h.hex()[:16]} missing from disk tier")
                if e.leases < 0:
                    raise AssertionError("negative lease count")
            for h in self.host.keys():  # noqa: SIM118 - a tier, not a dict
                if h not in self.entries or Tier.HOST not in self.entries[h].tiers:
                    raise AssertionError(f"host tier holds untracked page {h.hex()[:16]}")
            if self.disk is not None:
                for h in self.disk.keys():  # noqa: SIM118 - a tier, not a dict
                    if h not in self.entries or Tier.DISK not in self.entries[h].tiers:
                        raise AssertionError(f"disk tier holds untracked page {h.hex()[:16]}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        self._write_queue.put(None)
        self._writer.join(timeout=30)
