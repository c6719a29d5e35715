"""Making room on the disk tier: pages only the disk holds are dropped, in the eviction policy's
order, until a new file fits; they leave every tier (returned in `gone`, for the caller to unlink
from the index). Pages that also have a host copy stay (they are written back, not lost).

The victims are claimed in one short critical section of the page table (`pick_victims`:
unleased, unpinned, not busy) and settled at once, before any file is deleted.
"""

from __future__ import annotations

from dss.errors import CapacityError
from dss.pages.eviction import EvictionPolicy
from dss.pages.placement.copies import PageCopies
from dss.pages.placement.counters import TierCounters
from dss.pages.table import PageEntry, PageTable
from dss.pages.tiers.disk import DiskTier
from dss.types import PageHash, Tier


class DiskRoom:
    def __init__(
        self,
        table: PageTable,
        disk: DiskTier,
        policy: EvictionPolicy,
        copies: PageCopies,
        counters: TierCounters,
    ) -> None:
        self._table = table
        self._disk = disk
        self._policy = policy
        self._copies = copies
        self._counters = counters

    def make_room(self, nbytes: int, gone: list[PageHash]) -> None:
        """Drop pages that only the disk holds until `nbytes` fit (appended to `gone`)."""
        need = nbytes - self._disk.free_bytes
        if need <= 0:
            return
        victims = self._table.pick_victims(lambda e: e.tiers == {Tier.DISK}, self._policy, need, _disk_size)
        if not victims:
            raise CapacityError("disk tier is full of pages in use or pinned")
        ended = [e for v in victims if (e := self._table.settle(v.meta.hash, _off_disk)) is not None]
        for e in ended:
            e.tiers.add(Tier.DISK)  # settled without tiers; its file is ours to delete
        self._copies.destroy(ended)
        self._counters.count("evictions", Tier.DISK, len(victims))
        gone.extend(v.meta.hash for v in victims)


def _disk_size(e: PageEntry) -> int:
    return e.disk_bytes or e.meta.nbytes


def _off_disk(e: PageEntry) -> None:
    e.tiers.discard(Tier.DISK)
