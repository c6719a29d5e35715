"""The tier manager: moving page bytes between the tiers, without holding a lock while doing it.

Policy across the tier backends (which know nothing of each other): promotion on hit (remote or
disk → host), write-behind of committed pages to the remote tier (Redis, shared by a
fleet; it is self-indexing, so its copies are not tracked here: a page the table lists as `REMOTE`
only is one a lookup found there, about to be promoted), demotion under pressure (host → disk
first: write-back), write-through of committed pages (called by `dss.ops.writeback`), pins for hot
public prefixes, retention classes and demotion on request (host → disk, for `dss.ops.retention`),
and dropping pages everywhere (eviction from the last tier, erasure, corruption).

Every move follows one pattern: claim the page in the `PageTable` (a short critical section),
copy / compress / encrypt / write / fsync with no lock held, then settle the result in another
short critical section. The table's lock is a leaf; the tier backends' locks are leaves too and
are never taken while the table's is held. So the lock order is simply: none is nested.

Nothing here knows about the index. A page that leaves every tier (evicted from the last one,
dropped as corrupt) is appended to the `gone` list the caller passes in; the caller unlinks it
from the index after the call returns. No callback runs upward.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from dss.errors import CapacityError, CorruptPage, KeyDestroyed, PageMissing, StorageError, TierUnavailable
from dss.pages.encoder import PageCodecProcess
from dss.pages.eviction import EvictionPolicy, PageStats, RetentionClass
from dss.pages.meta import PageMeta
from dss.pages.pagefile import encode_page
from dss.pages.rows import PageRows
from dss.pages.table import Held, PageEntry, PageTable
from dss.pages.tiers.disk import DiskTier
from dss.pages.tiers.host import HostTier
from dss.pages.tiers.remote import RemoteTier
from dss.types import PageHash, TenantId, Tier
from dss.wire import SlotRef

log = logging.getLogger("dss.pages")

DataKeyLookup = Callable[[TenantId], bytes]
"""Returns the tenant's data key (creating it on first use); raises KeyDestroyed after an erasure."""

_WAIT_BUSY_S = 10.0  # how long a promotion waits for another thread's move of the same page
_PROBE_EVERY_S = 5.0  # how often an unavailable disk tier is probed before a write


@dataclass
class TierCounters:
    """Monotonic counters per tier, read by the metrics exporter. Own leaf lock."""

    hits_pages: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    promotions: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    evictions: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    corrupt_pages: int = 0
    disk_write_errors: int = 0
    disk_full_skips: int = 0  # write-throughs skipped: the disk was full of pages it may not evict
    pages_dropped: int = 0
    demoted_pages: int = 0  # host pages moved to disk on request (`demote_to_disk`), not for room
    remote_writes: int = 0  # pages copied to the remote tier (write-behind)
    remote_write_errors: int = 0
    remote_misses: int = 0  # pages a lookup found in the remote tier that were gone when read
    remote_read_bytes: int = 0  # bytes at rest read from the remote tier
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, name: str, tier: Tier | None = None, n: int = 1) -> None:
        with self._lock:
            if tier is None:
                setattr(self, name, getattr(self, name) + n)
            else:
                getattr(self, name)[tier] += n


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
        self._data_key = data_key
        self.encoder = encoder
        self.counters = TierCounters()
        self._next_probe = 0.0

    # ------------------------------------------------------------------ queries
    def contains(self, page: PageHash) -> bool:
        return self.table.contains(page)

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

    def valid(self, held: Held, ref: SlotRef | None) -> bool:
        return self.table.valid(held, ref)

    def set_pinned(self, pages: Iterable[PageHash], pinned: bool) -> None:
        self.table.set_pinned(pages, pinned)

    def set_retention(self, classes: Mapping[PageHash, RetentionClass]) -> int:
        """The retention class of each present page (eviction goes class by class, see
        `dss.pages.eviction`); returns how many pages were present."""
        return self.table.set_retention(classes)

    # ------------------------------------------------------------------ writing
    def reserve_host(self, nbytes: int, gone: list[PageHash]) -> SlotRef:
        """A free host slot for a page about to be written, evicting (and writing back) if needed."""
        for _ in range(3):
            try:
                return self.host.reserve(nbytes)
            except CapacityError:
                self._make_room_host(nbytes, gone)
        return self.host.reserve(nbytes)  # another thread took the room we made thrice: give up

    def release_host(self, ref: SlotRef) -> None:
        self.host.release(ref)

    def zero_host(self, ref: SlotRef) -> None:
        """Zero a reserved slot that stays reserved (its owner may still write into it; it is
        zeroed again when released)."""
        self.host.slot_array(ref).fill(0)

    def _free_page_slot(self, page: PageHash, serial: int, ref: SlotRef) -> None:
        """Free the host slot a page no longer has (erased, dropped, demoted). Its bytes are
        zeroed and its generation bumped now; the slot itself is freed only once no reader holds
        a lease on the page: a reader may be copying from it, and a slot freed under it could be
        refilled with another page (another tenant's) before that copy is done."""
        scrubbed = self.host.scrub(ref)
        if not self.table.park(page, serial, scrubbed):
            self.host.release(scrubbed)

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
        """Write-through of one host page (the background writer). False when it was not written
        (gone, already on disk, being moved, disk unavailable or full of pages in use)."""
        claimed = self.table.claim(page, lambda e: Tier.HOST in e.tiers and Tier.DISK not in e.tiers)
        if claimed is None:
            return False
        written = self._write_claimed(claimed, gone)
        if written >= 0:
            self._write_remote(claimed, written)

        def add_disk(e: PageEntry) -> None:
            e.tiers.add(Tier.DISK)
            e.disk_bytes = written

        doomed = self.table.settle(page, add_disk if written > 0 else None)
        if doomed is not None:  # erased or dropped while we wrote: our copies go too
            self._destroy([doomed], extra_disk=written > 0)
            return False
        if written < 0:  # the slot's bytes no longer match their checksum: never persist or serve them
            self.counters.count("corrupt_pages")
            gone.extend(self.drop([page]))
        return written > 0

    def _write_claimed(self, entry: PageEntry, gone: list[PageHash]) -> int:
        """Encrypt, compress and write a page we claimed (no lock held). Bytes on disk; 0 when not
        written; -1 when the page's bytes failed their checksum (the caller drops the page)."""
        disk, meta, ref = self.disk, entry.meta, entry.host_ref
        if disk is None or ref is None:
            return 0
        if not disk.available and not self._probe(disk):
            return 0
        try:
            key = self._data_key(meta.tenant)
        except KeyDestroyed:
            return 0
        try:
            written = self._write_file(disk, meta, ref, key, gone)
        except CorruptPage as exc:
            log.error(
                "page %s changed in memory since it was stored (%s); dropped", meta.hash.hex()[:16], exc
            )
            return -1
        except TierUnavailable as exc:
            self.counters.count("disk_write_errors")
            log.error("disk tier unavailable, serving from memory only: %s", exc)
            return 0
        except CapacityError as exc:  # full of pages in use, pinned or also in memory: stays in memory
            self.counters.count("disk_full_skips")
            log.debug("page %s not written through: %s", meta.hash.hex()[:16], exc)
            return 0
        if not written:
            return 0
        try:
            self.rows.add(meta, written, key)
        except Exception:
            log.exception("could not record page %s on disk; file removed", meta.hash.hex()[:16])
            disk.delete(meta.hash)
            return 0
        return written

    def _write_remote(self, entry: PageEntry, disk_bytes: int) -> None:
        """Write-behind of a claimed page to the remote tier: the disk tier's file as it is when
        one was just written (the same at-rest format), else the page encoded here. Skipped when
        Redis has it already (another server wrote it) or is unavailable; never raises."""
        remote, meta, ref = self.remote, entry.meta, entry.host_ref
        if remote is None or ref is None or not remote.config.write_behind:
            return  # (an unavailable tier fails fast below, and is tried again later)
        try:
            if remote.exists([meta.hash])[0]:
                return
            key = self._data_key(meta.tenant)
            blob: bytes | None = None
            if disk_bytes > 0 and self.disk is not None:
                with contextlib.suppress(OSError):
                    blob = self.disk.path_of(meta.hash).read_bytes()
            if blob is None:
                blob = encode_page(meta, self.host.slot_array(ref).data, remote.codec, key)
            if remote.put(meta.hash, meta.tenant, blob):
                self.counters.count("remote_writes")
        except KeyDestroyed:
            return
        except (TierUnavailable, CorruptPage) as exc:
            self.counters.count("remote_write_errors")
            log.debug("page %s not written to the remote tier: %s", meta.hash.hex()[:16], exc)

    def _write_file(
        self, disk: DiskTier, meta: PageMeta, ref: SlotRef, key: bytes, gone: list[PageHash]
    ) -> int:
        """The page file, encoded by the helper process when there is one (else here); evicts
        disk-only pages when the tier is full."""
        if self.encoder is not None:
            tmp = disk.temp_path(meta.hash)
            try:
                size = self.encoder.encode_to_file(meta, ref, key, tmp, disk.fsync)
                try:
                    return disk.adopt(meta, tmp, size)
                except CapacityError:
                    self._make_room_disk(size, gone)
                    return disk.adopt(meta, tmp, size)
            except TierUnavailable as exc:
                if disk.available:  # the helper died, not the disk: write it here instead
                    log.warning("page codec process failed (%s); encoding in this process", exc)
                else:
                    raise
            finally:
                disk.discard_temp(tmp)
        raw = self.host.slot_array(ref).data
        try:
            return disk.write(meta, raw, key)
        except CapacityError:
            self._make_room_disk(meta.nbytes, gone)
            return disk.write(meta, raw, key)

    def _probe(self, disk: DiskTier) -> bool:
        """Whether an unavailable disk tier works again (a real write, at most every few seconds)."""
        now = time.monotonic()
        if now < self._next_probe:
            return False
        self._next_probe = now + _PROBE_EVERY_S
        if disk.probe():
            log.warning("disk tier at %s is writable again", disk.root)
            return True
        return False

    # ------------------------------------------------------------------ promotion
    def promote_to_host(self, page: PageHash, gone: list[PageHash]) -> SlotRef | None:
        """Bring a page into the host arena (from disk if needed). None when it cannot be had:
        unknown, corrupt (then dropped and counted), key destroyed, the disk tier failed, or no
        host room (everything leased). The caller holds a lease on the page."""
        claimed: PageEntry | None = None
        for _ in range(3):
            e = self.table.get(page)
            if e is None:
                return None
            if Tier.HOST in e.tiers:
                return e.host_ref
            if e.tiers == {Tier.REMOTE}:
                return self._promote_from_remote(page, gone)
            if Tier.DISK not in e.tiers or self.disk is None:
                return None
            claimed = self.table.claim(page, lambda x: Tier.HOST not in x.tiers and Tier.DISK in x.tiers)
            if claimed is not None:
                break
            self.table.wait_unbusy(page, _WAIT_BUSY_S)  # another thread is moving it
        if claimed is None:
            return None
        ref, ok, corrupt = self._read_claimed(claimed, gone)

        def add_host(e: PageEntry) -> None:
            e.tiers.add(Tier.HOST)
            e.host_ref = ref

        doomed = self.table.settle(page, add_host if ok else None)
        if doomed is not None:
            if ref is not None:
                self.host.release(ref)
            self._destroy([doomed])
            return None
        if not ok:
            if ref is not None:
                self.host.release(ref)
            if corrupt:
                self.counters.count("corrupt_pages")
                gone.extend(self.drop([page]))
            return None
        self.counters.count("promotions", Tier.HOST)
        self.counters.count("hits_pages", Tier.DISK)
        return ref

    def _promote_from_remote(self, page: PageHash, gone: list[PageHash]) -> SlotRef | None:
        """Read a page only the remote tier holds into a new host slot. On any failure (Redis
        unavailable, the page evicted or expired there, a value that fails its checks) the entry is
        dropped: it was only a hint from a lookup, and the engine recomputes the page."""
        remote = self.remote
        claimed = self.table.claim(page, lambda x: x.tiers == {Tier.REMOTE})
        if claimed is None:
            self.table.wait_unbusy(page, _WAIT_BUSY_S)
            e = self.table.get(page)
            return e.host_ref if e is not None and Tier.HOST in e.tiers else None
        ref: SlotRef | None = None
        ok = False
        if remote is not None:
            try:
                ref = self.reserve_host(claimed.meta.nbytes, gone)
                key = self._data_key(claimed.meta.tenant)
                header, _tokens, _raw = remote.read(page, key, out=self.host.slot_array(ref))
                claimed.meta.checksum = header.checksum
                self.counters.count("remote_read_bytes", n=header.file_len)
                ok = True
            except (CapacityError, KeyDestroyed):
                pass
            except CorruptPage as exc:
                self.counters.count("corrupt_pages")
                log.warning("page %s unreadable in the remote tier (%s); recomputed", page.hex()[:16], exc)
            except (PageMissing, TierUnavailable) as exc:
                self.counters.count("remote_misses")
                log.debug("page %s not read from the remote tier: %s", page.hex()[:16], exc)

        def to_host(e: PageEntry) -> None:
            e.tiers = {Tier.HOST}
            e.host_ref = ref
            e.meta.checksum = claimed.meta.checksum

        doomed = self.table.settle(page, to_host if ok else None)
        if doomed is not None or not ok:
            if ref is not None:
                self.host.release(ref)
            if doomed is None:
                gone.extend(self.drop([page]))
            return None
        self.counters.count("promotions", Tier.HOST)
        self.counters.count("hits_pages", Tier.REMOTE)
        return ref

    def _read_claimed(self, entry: PageEntry, gone: list[PageHash]) -> tuple[SlotRef | None, bool, bool]:
        """Decode a claimed disk page straight into a new host slot: (slot, ok, corrupt)."""
        assert self.disk is not None
        page = entry.meta.hash
        try:
            ref = self.reserve_host(entry.meta.nbytes, gone)
        except (CapacityError, TierUnavailable):  # no room, or no arena (no shared memory for it)
            return None, False, False
        try:
            key = self._data_key(entry.meta.tenant)
            self._read_file(page, key, ref)
            return ref, True, False
        except (CorruptPage, KeyDestroyed) as exc:
            log.warning("page %s unreadable on disk (%s); dropped, will be recomputed", page.hex()[:16], exc)
            return ref, False, True
        except (StorageError, OSError) as exc:  # tier unavailable, page file gone
            log.warning("disk tier read failed for %s: %s", page.hex()[:16], exc)
            return ref, False, False

    def _read_file(self, page: PageHash, key: bytes, ref: SlotRef) -> None:
        """Decode a page file into a slot: in the helper process when there is one (else here)."""
        disk = self.disk
        assert disk is not None
        if self.encoder is not None:
            try:
                self.encoder.decode_file(disk.path_of(page), page, key, ref)
                return
            except CorruptPage:
                disk.drop_corrupt(page)
                raise
            except PageMissing:
                raise
            except TierUnavailable as exc:
                log.warning("page codec process failed (%s); decoding in this process", exc)
        disk.read(page, key, out=self.host.slot_array(ref))

    # ------------------------------------------------------------------ demotion on request
    def demote_to_disk(self, pages: Iterable[PageHash], gone: list[PageHash]) -> int:
        """Move these pages off the host tier onto the disk tier (written back first when only
        the host has them); returns how many left the host. A page stays on the host when it is
        leased, pinned (a public prefix's pin, or the `PINNED` retention class: such a page stays
        where it is for everyone), being moved, or cannot be written to disk (no disk tier, disk
        unavailable or full): demotion never loses a page, unlike eviction. A page whose bytes fail
        their checksum is dropped (appended to `gone`)."""
        if self.disk is None:
            return 0
        moved = 0
        for page in pages:
            claimed = self.table.claim(page, _demotable)
            if claimed is None:
                continue
            written = 0
            if Tier.DISK not in claimed.tiers:
                written = self._write_claimed(claimed, gone)
                if written <= 0:
                    doomed = self.table.settle(page)
                    if doomed is not None:
                        self._destroy([doomed])
                    elif written < 0:
                        self.counters.count("corrupt_pages")
                        gone.extend(self.drop([page]))
                    continue

            def off_host(e: PageEntry, written: int = written) -> None:
                if written:
                    e.tiers.add(Tier.DISK)
                    e.disk_bytes = written
                e.tiers.discard(Tier.HOST)
                e.host_ref = None

            ended = self.table.settle(page, off_host)
            if ended is not None:  # doomed while we wrote: every copy goes
                self._destroy([ended], extra_disk=bool(written))
                continue
            assert claimed.host_ref is not None
            self._free_page_slot(page, claimed.serial, claimed.host_ref)
            moved += 1
        if moved:
            self.counters.count("demoted_pages", n=moved)
        return moved

    # ------------------------------------------------------------------ eviction
    def _make_room_host(self, nbytes: int, gone: list[PageHash]) -> None:
        """Demote host pages until `nbytes` fit: pages already on disk first, then others after
        writing them back; a page that cannot be written back is dropped (appended to `gone`)."""
        need = nbytes - self.host.free_bytes
        if need <= 0:
            return
        victims = self.table.pick_victims(
            lambda e: Tier.HOST in e.tiers and len(e.tiers) > 1, self.policy, need, _raw_size
        )
        freed = sum(v.meta.nbytes for v in victims)
        if freed < need:
            victims += self.table.pick_victims(
                lambda e: Tier.HOST in e.tiers, self.policy, need - freed, _raw_size
            )
        if not victims:
            raise CapacityError("host tier is full of pages in use or pinned")
        for v in victims:
            self._demote_host(v, gone)

    def _demote_host(self, victim: PageEntry, gone: list[PageHash]) -> None:
        """Take a claimed page off the host tier, writing it back to disk first when only the host
        has it (then it keeps its bytes; otherwise it leaves every tier)."""
        written = 0
        if len(victim.tiers) == 1:
            written = max(0, self._write_claimed(victim, gone))  # a corrupt page just goes

        def off_host(e: PageEntry) -> None:
            if written:
                e.tiers.add(Tier.DISK)
                e.disk_bytes = written
            e.tiers.discard(Tier.HOST)
            e.host_ref = None

        ended = self.table.settle(victim.meta.hash, off_host)
        if victim.host_ref is not None:  # in every case: demoted, dropped or doomed
            # A reader may have leased the page after it was picked: then the slot waits for it.
            self._free_page_slot(victim.meta.hash, victim.serial, victim.host_ref)
        self.counters.count("evictions", Tier.HOST)
        if ended is not None:  # left every tier (or was doomed meanwhile)
            ended.host_ref = None
            self._destroy([ended], extra_disk=bool(written))
            gone.append(victim.meta.hash)

    def _make_room_disk(self, nbytes: int, gone: list[PageHash]) -> None:
        """Drop pages that only the disk holds until `nbytes` fit (appended to `gone`)."""
        disk = self.disk
        assert disk is not None
        need = nbytes - disk.free_bytes
        if need <= 0:
            return
        victims = self.table.pick_victims(lambda e: e.tiers == {Tier.DISK}, self.policy, need, _disk_size)
        if not victims:
            raise CapacityError("disk tier is full of pages in use or pinned")
        ended = [e for v in victims if (e := self.table.settle(v.meta.hash, _off_disk)) is not None]
        for e in ended:
            e.tiers.add(Tier.DISK)  # settled without tiers; its file is ours to delete
        self._destroy(ended)
        self.counters.count("evictions", Tier.DISK, len(victims))
        gone.extend(v.meta.hash for v in victims)

    # ------------------------------------------------------------------ dropping
    def drop(self, pages: Iterable[PageHash]) -> list[PageHash]:
        """Remove pages from every tier now (pages being moved go when their move settles).
        Returns the pages that were present: gone for every reader from now on."""
        removed, gone = self.table.remove(pages)
        self._destroy(removed)
        self.counters.count("pages_dropped", n=len(gone))
        return gone

    def detach(self, pages: Iterable[PageHash]) -> tuple[list[PageEntry], list[PageHash]]:
        """The first half of a drop (erasure): out of the table, copies still in place until
        `destroy` (after the caller's metadata commit)."""
        removed, gone = self.table.remove(pages)
        self.counters.count("pages_dropped", n=len(gone))
        return removed, gone

    def destroy(self, entries: list[PageEntry], rows_deleted: bool = False) -> None:
        self._destroy(entries, rows_deleted=rows_deleted)

    def _destroy(
        self,
        entries: list[PageEntry],
        extra_disk: bool = False,
        rows_deleted: bool = False,
    ) -> None:
        """Delete the copies of entries that are out of the table: database rows first, then
        the irreversible part (zeroing slots, unlinking files)."""
        try:
            on_disk = [e.meta.hash for e in entries if extra_disk or Tier.DISK in e.tiers]
            if on_disk and not rows_deleted:
                self.rows.delete(on_disk)
            for e in entries:
                if e.host_ref is not None:
                    self._free_page_slot(e.meta.hash, e.serial, e.host_ref)
                if self.disk is not None and (extra_disk or Tier.DISK in e.tiers):
                    self.disk.delete(e.meta.hash)
        finally:
            self.table.deleted(e.meta.hash for e in entries)

    def abandon(self, entries: list[PageEntry]) -> None:
        """Detached entries whose copies stay (the operation that detached them failed): their
        hashes may be stored again. Their host slots are freed; files stay for recovery."""
        for e in entries:
            if e.host_ref is not None:
                self._free_page_slot(e.meta.hash, e.serial, e.host_ref)
        self.table.deleted(e.meta.hash for e in entries)

    def wait_settled(self, pages: Iterable[PageHash], timeout_s: float) -> bool:
        return self.table.wait_settled(pages, timeout_s)

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


def _demotable(e: PageEntry) -> bool:
    """`demote_to_disk`'s claim test (called under the table's lock): on the host, unleased, unpinned."""
    return (
        Tier.HOST in e.tiers
        and e.leases == 0
        and not e.stats.pinned
        and e.stats.retention is not RetentionClass.PINNED
    )


def _raw_size(e: PageEntry) -> int:
    return e.meta.nbytes


def _disk_size(e: PageEntry) -> int:
    return e.disk_bytes or e.meta.nbytes


def _off_disk(e: PageEntry) -> None:
    e.tiers.discard(Tier.DISK)


def _usage(entries: Iterable[PageEntry]) -> dict[Tier, tuple[int, int]]:
    out: dict[Tier, tuple[int, int]] = dict.fromkeys(Tier, (0, 0))
    for e in entries:
        for t in e.tiers:
            n, b = out[t]
            out[t] = (n + 1, b + (e.disk_bytes if t is Tier.DISK else e.meta.nbytes))
    return out
