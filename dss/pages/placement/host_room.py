"""Making room on the host tier: a free slot for a page about to be written, evicting if needed.

Pages that also have another copy go first (nothing is lost), then host-only pages, written back
to disk first (`PageWriter.write_claimed`); a page that cannot be written back leaves every tier
(returned in `gone`): eviction may lose a page, demotion on request never does.

The victims are claimed in short critical sections of the page table (`pick_victims`: unleased,
unpinned, not busy), moved one by one with no lock held, and each settled after its move. Every
victim is settled whatever happens: those not reached when something raises are released
unchanged (`PageCopies.release`), so a failed eviction never leaves a page claimed (a claimed
page is never picked again: enough of them and the tier refuses every save).
"""

from __future__ import annotations

from dss.errors import CapacityError
from dss.pages.eviction import EvictionPolicy
from dss.pages.placement.copies import PageCopies
from dss.pages.placement.counters import TierCounters
from dss.pages.placement.writer import PageWriter
from dss.pages.table import PageEntry, PageTable
from dss.pages.tiers.host import HostTier
from dss.types import PageHash, Tier
from dss.wire import SlotRef


class HostRoom:
    def __init__(
        self,
        table: PageTable,
        host: HostTier,
        policy: EvictionPolicy,
        writer: PageWriter,
        copies: PageCopies,
        counters: TierCounters,
    ) -> None:
        self._table = table
        self._host = host
        self._policy = policy
        self._writer = writer
        self._copies = copies
        self._counters = counters

    def reserve(self, nbytes: int, gone: list[PageHash]) -> SlotRef:
        """A free host slot for a page about to be written, evicting (and writing back) if needed."""
        for _ in range(3):
            try:
                return self._host.reserve(nbytes)
            except CapacityError:
                self._make_room(nbytes, gone)
        return self._host.reserve(nbytes)  # another thread took the room we made thrice: give up

    def _make_room(self, nbytes: int, gone: list[PageHash]) -> None:
        """Evict host pages until `nbytes` fit: pages with another copy first, then others after
        writing them back; a page that cannot be written back is dropped (appended to `gone`)."""
        need = nbytes - self._host.free_bytes
        if need <= 0:
            return
        victims = self._table.pick_victims(
            lambda e: Tier.HOST in e.tiers and len(e.tiers) > 1, self._policy, need, _raw_size
        )
        freed = sum(v.meta.nbytes for v in victims)
        if freed < need:
            victims += self._table.pick_victims(
                lambda e: Tier.HOST in e.tiers, self._policy, need - freed, _raw_size
            )
        if not victims:
            raise CapacityError("host tier is full of pages in use or pinned")
        done = 0
        try:
            for v in victims:
                done += 1  # settled by `_evict`, whatever it raises after the settle
                self._evict(v, gone)
        finally:
            self._copies.release(victims[done:])

    def _evict(self, victim: PageEntry, gone: list[PageHash]) -> None:
        """Take a claimed page off the host tier, writing it back to disk first when only the host
        has it (then it keeps its bytes; otherwise it leaves every tier)."""
        written = 0
        if len(victim.tiers) == 1:
            written = max(0, self._writer.write_claimed(victim, gone))  # a corrupt page just goes

        def off_host(e: PageEntry) -> None:
            if written:
                e.tiers.add(Tier.DISK)
                e.disk_bytes = written
            e.tiers.discard(Tier.HOST)
            e.host_ref = None

        ended = self._table.settle(victim.meta.hash, off_host)
        if victim.host_ref is not None:  # in every case: demoted, dropped or doomed
            # A reader may have leased the page after it was picked: then the slot waits for it.
            self._copies.free_slot(victim.meta.hash, victim.serial, victim.host_ref)
        self._counters.count("evictions", Tier.HOST)
        if ended is not None:  # left every tier (or was doomed meanwhile)
            ended.host_ref = None
            self._copies.destroy([ended], extra_disk=bool(written))
            gone.append(victim.meta.hash)


def _raw_size(e: PageEntry) -> int:
    return e.meta.nbytes
