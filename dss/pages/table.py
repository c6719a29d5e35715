"""The page table: what the store knows about each page and which tiers hold its bytes.

Lock: `PageTable._lock` is a **leaf**. Every method takes it for a few dictionary operations and
returns; nothing called under it takes another lock, touches a tier, does I/O or calls back into
a caller. Tier work (copies, compression, encryption, files, database rows) is done by
`dss.pages.placement` outside the lock, on pages it has claimed here first.

Per page, two counters keep that work safe without holding the lock:
- `leases`: readers in flight (a load being copied by an engine, a save being linked into the
  index). A leased page is never picked for eviction, and its host slot is never freed while the
  lease lasts: a slot that leaves a leased page (erasure, a drop, a demotion that raced the
  lease) is zeroed and invalidated at once but `park`ed here, and handed back by the `unlease`
  that ends the last lease, so no other page (another tenant's) lands where a reader is copying.
- `busy`: one tier transition in flight (write-back to disk, promotion, demotion), owned by the
  thread that set it. Only the owner changes the page's tiers; eviction skips busy pages.

`remove` (erasure, eviction, corrupt pages) takes a page out of the table at once, whatever its
leases: a reader validates its copy afterwards (`valid`) and never trusts one that raced a
removal. A busy page is only marked `doomed`; its transition owner sees that when it finishes and
deletes the copies itself. Either way the caller gets back the entries whose copies it must
delete (irreversible steps, done after the table and any database rows are updated), and the
hash stays reserved until it reports them deleted (`deleted`): a page of the same content saved
again meanwhile is refused rather than have its new file or row removed by the old deletion.

Every change of a page's host and disk tiers is recorded, under the lock and in order, in
`events` (`dss.pages.events`) for the fingerprints an engine reads them for (`take_events`): a
page is stored in a tier when an entry with that tier is inserted or a transition settles with it,
and removed when a transition settles without it, or `remove` takes or dooms it (a doomed page is
gone for every reader, so for routers too).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from dss.pages.events import REPORTED_TIERS, PageEventLog
from dss.pages.eviction import EvictionPolicy, PageStats, RetentionClass, choose_victims
from dss.pages.meta import PageMeta
from dss.types import FingerprintId, PageHash, TenantId, Tier
from dss.wire import PAGE_REMOVED, PAGE_STORED, PageEvent, PageEventBatch, SlotRef

_serials = itertools.count(1)


@dataclass(slots=True)
class PageEntry:
    meta: PageMeta
    stats: PageStats
    tiers: set[Tier] = field(default_factory=set)
    host_ref: SlotRef | None = None
    disk_bytes: int = 0
    leases: int = 0
    busy: bool = False
    doomed: bool = False
    serial: int = field(default_factory=lambda: next(_serials))  # tells a re-created page apart
    created_wall: float = field(default_factory=time.time)

    def copy(self) -> PageEntry:
        """A snapshot for use outside the lock (tiers copied; meta is immutable in practice)."""
        return PageEntry(
            self.meta,
            self.stats,
            set(self.tiers),
            self.host_ref,
            self.disk_bytes,
            self.leases,
            self.busy,
            self.doomed,
            self.serial,
            self.created_wall,
        )


class Held(NamedTuple):
    """A page leased by a reader: what it must find unchanged when it validates its copy. A
    tuple: a load leases every page of its prompt, on every turn's path (a frozen dataclass cost
    0.8 us a page to build)."""

    hash: PageHash
    serial: int
    host_ref: SlotRef | None


class PageTable:
    def __init__(self, event_cap: int = 65536) -> None:
        self.events = PageEventLog(event_cap)
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # notified when a busy page settles
        self._entries: dict[PageHash, PageEntry] = {}
        self._deleting: dict[PageHash, int] = {}  # hashes whose copies are being deleted
        # Pages out of the table whose readers still hold leases: lease count by (hash, serial).
        self._lingering: dict[tuple[PageHash, int], int] = {}
        # Host slots whose freeing waits for those leases (or a present page's) to end.
        self._parked: dict[tuple[PageHash, int], list[SlotRef]] = {}

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def contains(self, page: PageHash) -> bool:
        with self._lock:
            e = self._entries.get(page)
            return e is not None and not e.doomed

    def present_prefix(self, pages: Iterable[PageHash]) -> int:
        """How many of `pages`, from the first, are present."""
        n = 0
        with self._lock:
            for h in pages:
                e = self._entries.get(h)
                if e is None or e.doomed:
                    break
                n += 1
        return n

    def missing(self, pages: Iterable[PageHash]) -> list[PageHash]:
        with self._lock:
            return [h for h in pages if h not in self._entries or self._entries[h].doomed]

    def get(self, page: PageHash) -> PageEntry | None:
        """A snapshot of the entry (None when absent or doomed)."""
        with self._lock:
            e = self._entries.get(page)
            return e.copy() if e is not None and not e.doomed else None

    def snapshot(self, tenant: TenantId | None = None) -> list[PageEntry]:
        with self._lock:
            return [
                e.copy()
                for e in self._entries.values()
                if not e.doomed and (tenant is None or e.meta.tenant == tenant)
            ]

    # ------------------------------------------------------------------ readers
    def lease_prefix(self, pages: Iterable[PageHash]) -> list[Held]:
        """Lease the present pages from the first on; stops at the first absent one."""
        out: list[Held] = []
        now = time.monotonic()
        with self._lock:
            for h in pages:
                e = self._entries.get(h)
                if e is None or e.doomed:
                    break
                e.leases += 1
                e.stats.last_access = now
                e.stats.hits += 1
                out.append(Held(h, e.serial, e.host_ref if Tier.HOST in e.tiers else None))
        return out

    def unlease(self, held: Iterable[Held]) -> list[SlotRef]:
        """End leases. Returns the host slots parked for pages whose last lease this was: the
        caller frees them (after this returns: no tier is touched under the lock)."""
        due: list[SlotRef] = []
        with self._lock:
            for h in held:
                key = (h.hash, h.serial)
                e = self._entries.get(h.hash)
                if e is not None and e.serial == h.serial:
                    if e.leases > 0:
                        e.leases -= 1
                    left = e.leases
                elif key in self._lingering:
                    left = self._lingering[key] - 1
                    if left > 0:
                        self._lingering[key] = left
                    else:
                        del self._lingering[key]
                else:
                    continue
                if left == 0 and key in self._parked:
                    due.extend(self._parked.pop(key))
        return due

    def park(self, page: PageHash, serial: int, ref: SlotRef) -> bool:
        """Keep a host slot that left page (`page`, `serial`) from being freed while the page is
        leased: True when parked (`unlease` hands it back later), False when the caller may free
        it now. The caller has already scrubbed it (zeroed, new generation): parking only delays
        the reuse, never the erasure of its bytes."""
        key = (page, serial)
        with self._lock:
            e = self._entries.get(page)
            leases = e.leases if e is not None and e.serial == serial else self._lingering.get(key, 0)
            if leases <= 0:
                return False
            self._parked.setdefault(key, []).append(ref)
            return True

    def parked_slots(self) -> list[SlotRef]:
        """Host slots waiting for leases to end (reserved in the host tier, owned by no page)."""
        with self._lock:
            return [ref for refs in self._parked.values() for ref in refs]

    def valid_each(self, copies: Iterable[tuple[Held, SlotRef | None]]) -> list[bool]:
        """For each reader's copy from a slot, whether it is of the page it leased (not erased,
        not moved): one lock for a whole load's pages."""
        with self._lock:
            return [self._valid(held, ref) for held, ref in copies]

    def _valid(self, held: Held, ref: SlotRef | None) -> bool:
        """Caller holds the lock."""
        e = self._entries.get(held.hash)
        return (
            e is not None
            and not e.doomed
            and e.serial == held.serial
            and ref is not None
            and e.host_ref == ref
            and Tier.HOST in e.tiers
        )

    def set_pinned(self, pages: Iterable[PageHash], pinned: bool) -> None:
        with self._lock:
            for h in pages:
                e = self._entries.get(h)
                if e is not None:
                    e.stats.pinned = pinned

    def set_retention(self, classes: Mapping[PageHash, RetentionClass]) -> int:
        """Set the retention class of present pages; returns how many were present."""
        n = 0
        with self._lock:
            for h, c in classes.items():
                e = self._entries.get(h)
                if e is not None and not e.doomed:
                    e.stats.retention = c
                    n += 1
        return n

    # ------------------------------------------------------------------ adding
    def insert(self, entry: PageEntry) -> bool:
        """Add a page; False when it is already present or its old copies are still being deleted
        (then the caller frees its copies)."""
        with self._lock:
            if entry.meta.hash in self._entries or entry.meta.hash in self._deleting:
                return False
            self._entries[entry.meta.hash] = entry
            self._note(entry, frozenset())
            return True

    # ------------------------------------------------------------------ transitions
    def claim(
        self, page: PageHash, want: Callable[[PageEntry], bool], lease: bool = False
    ) -> PageEntry | None:
        """Mark the page busy for a transition when `want(entry)` holds; returns a snapshot.
        `want` is a pure predicate over the entry (it runs under the lock)."""
        with self._lock:
            e = self._entries.get(page)
            if e is None or e.doomed or e.busy or not want(e):
                return None
            e.busy = True
            if lease:
                e.leases += 1
            return e.copy()

    def wait_unbusy(self, page: PageHash, timeout_s: float) -> None:
        """Wait (bounded) until another thread's transition of `page` settles."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                e = self._entries.get(page)
                left = deadline - time.monotonic()
                if e is None or not e.busy or left <= 0:
                    return
                self._settled.wait(left)

    def settle(
        self, page: PageHash, update: Callable[[PageEntry], None] | None = None, unlease: bool = False
    ) -> PageEntry | None:
        """End the caller's transition. Applies `update` (a pure mutation of the entry) unless the
        page was doomed meanwhile; then the entry is removed and returned, and the caller deletes
        the copies it holds. Returns None when the page stays."""
        with self._lock:
            e = self._entries.get(page)
            if e is None:
                return None
            e.busy = False
            if unlease and e.leases > 0:
                e.leases -= 1
            self._settled.notify_all()
            if e.doomed:
                self._take(page)
                return e
            before = _reported(e)
            if update is not None:
                update(e)
            if not e.tiers:
                self._take(page)
                self._note(e, before)
                return e
            self._note(e, before)
            return None

    def _take(self, page: PageHash) -> None:
        """Caller holds the lock: the entry leaves the table; its copies are being deleted. Its
        leases are remembered: its host slot must not be freed before they end (`park`)."""
        e = self._entries.pop(page)
        self._deleting[page] = self._deleting.get(page, 0) + 1
        if e.leases > 0:
            self._lingering[(page, e.serial)] = e.leases

    def deleted(self, pages: Iterable[PageHash]) -> None:
        """The copies of these removed pages are gone: the hashes may be stored again."""
        with self._lock:
            for h in pages:
                n = self._deleting.get(h, 0) - 1
                if n > 0:
                    self._deleting[h] = n
                else:
                    self._deleting.pop(h, None)
            self._settled.notify_all()

    def pick_victims(
        self,
        in_tier: Callable[[PageEntry], bool],
        policy: EvictionPolicy,
        need_bytes: int,
        size_of: Callable[[PageEntry], int],
    ) -> list[PageEntry]:
        """Claim (mark busy) the pages to evict to free `need_bytes`: unleased, unpinned, idle
        pages for which `in_tier` holds, in the policy's order. Returns snapshots."""
        with self._lock:
            now = time.monotonic()
            candidates = [
                (h, _sized(e.stats, size_of(e)))
                for h, e in self._entries.items()
                if e.leases == 0 and not e.busy and not e.doomed and in_tier(e)
            ]
            victims = choose_victims(candidates, policy, now, need_bytes)
            out = []
            for h in victims:
                e = self._entries[h]
                e.busy = True
                out.append(e.copy())
            return out

    # ------------------------------------------------------------------ removing
    def remove(self, pages: Iterable[PageHash]) -> tuple[list[PageEntry], list[PageHash]]:
        """Take pages out of the table at once. Returns (entries whose copies the caller deletes,
        hashes of every page that was present: gone for every reader from now on)."""
        removed: list[PageEntry] = []
        gone: list[PageHash] = []
        with self._lock:
            for h in pages:
                e = self._entries.get(h)
                if e is None or e.doomed:
                    continue
                gone.append(h)
                before = _reported(e)
                if e.busy:
                    e.doomed = True  # the transition owner deletes the copies
                else:
                    self._take(h)
                    removed.append(e)
                self._note(e, before)
        return removed, gone

    def wait_settled(self, pages: Iterable[PageHash], timeout_s: float) -> bool:
        """Wait until none of `pages` is still in the table (doomed pages whose transition has
        not finished yet) or being deleted by a mover. True when all are gone."""
        want = set(pages)
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if not any(h in self._entries or h in self._deleting for h in want):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._settled.wait(left)

    def pages_of_tenant(self, tenant: TenantId) -> list[PageHash]:
        with self._lock:
            return [h for h, e in self._entries.items() if e.meta.tenant == tenant and not e.doomed]

    # ------------------------------------------------------------------ events
    def _note(self, e: PageEntry, before: frozenset[Tier]) -> None:
        """Caller holds the lock: record the change of `e`'s reported tiers since `before`
        (stores first, so a page moving between tiers is never absent from a router's view)."""
        fid = e.meta.fingerprint
        if not self.events.recording(fid):
            return
        after = _reported(e) if self._entries.get(e.meta.hash) is e else frozenset()
        if after == before:
            return
        self.events.record(
            fid,
            [*_stored(e, after - before), *(_removed(e, t) for t in sorted(before - after))],
        )

    def event_stats(self) -> dict[str, int]:
        with self._lock:
            return self.events.stats()

    def take_events(self, fid: FingerprintId, epoch: str, after: int, limit: int = 4096) -> PageEventBatch:
        """The page events of fingerprint `fid` after id `after` of log `epoch` (recording starts
        at the first call). When the reader cannot continue (`PageEventLog.since`), a resync: the
        pages of `fid` the table holds now, each page after its parent, taken under the lock with
        the cursor, so that the events that follow apply to exactly this view."""
        with self._lock:
            self.events.subscribe(fid)
            batch = self.events.since(fid, epoch, after, limit)
            if batch is not None:
                return batch
            held = sorted(
                (e for e in self._entries.values() if e.meta.fingerprint == fid and not e.doomed),
                key=lambda e: e.meta.index,
            )
            return PageEventBatch(
                self.events.epoch,
                tuple(ev for e in held for ev in _stored(e, _reported(e))),
                self.events.last_id(fid),
                resync=True,
                dropped=self.events.dropped(fid),
            )


def _reported(e: PageEntry) -> frozenset[Tier]:
    return frozenset() if e.doomed else frozenset(e.tiers & REPORTED_TIERS)


def _stored(e: PageEntry, tiers: frozenset[Tier]) -> list[PageEvent]:
    if not tiers:
        return []
    m = e.meta
    parent = None if m.index == 0 else m.parent
    tokens = tuple(int(t) for t in m.tokens.tolist())
    return [
        PageEvent(0, PAGE_STORED, t.value, m.hash, parent, m.index, len(tokens), str(m.tenant), tokens)
        for t in sorted(tiers)
    ]


def _removed(e: PageEntry, tier: Tier) -> PageEvent:
    m = e.meta
    parent = None if m.index == 0 else m.parent
    return PageEvent(0, PAGE_REMOVED, tier.value, m.hash, parent, m.index, m.n_tokens, str(m.tenant))


def _sized(stats: PageStats, nbytes: int) -> PageStats:
    """Eviction counts the bytes a page frees in the tier at hand (disk pages are compressed)."""
    if stats.nbytes == nbytes:
        return stats
    return PageStats(
        stats.last_access, stats.hits, stats.created, stats.index, nbytes, stats.pinned, stats.retention
    )
