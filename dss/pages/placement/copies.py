"""Deleting the copies of pages that left the page table, and giving up claims.

Order: database rows first, then the irreversible part (zeroing host slots, unlinking files); the
hash is reported `deleted` to the table last, so a page of the same content saved meanwhile is
refused rather than have its new copies removed by this deletion. A host slot is zeroed and its
generation bumped at once, but freed only once no reader holds a lease on its page
(`PageTable.park`): a reader may be copying from it. An erasure zeroes its pages' host slots
when it takes them out of the table (`detach`), before its commit, so that an engine's own check
of its copies (the slots' generations) refuses them from then on.

No lock of its own; it calls the table (a leaf) and the tiers, never under a lock.
"""

from __future__ import annotations

from collections.abc import Iterable

from dss.pages.placement.counters import TierCounters
from dss.pages.rows import PageRows
from dss.pages.table import PageEntry, PageTable
from dss.pages.tiers.disk import DiskTier
from dss.pages.tiers.host import HostTier
from dss.types import PageHash, Tier
from dss.wire import SlotRef


class PageCopies:
    def __init__(
        self, table: PageTable, host: HostTier, disk: DiskTier | None, rows: PageRows, counters: TierCounters
    ) -> None:
        self._table = table
        self._host = host
        self._disk = disk
        self._rows = rows
        self._counters = counters

    def free_slot(self, page: PageHash, serial: int, ref: SlotRef) -> None:
        """Free the host slot a page no longer has (erased, dropped, demoted): zeroed now, freed
        once no reader holds a lease on the page (another tenant's page could land there)."""
        scrubbed = self._host.scrub(ref)
        if not self._table.park(page, serial, scrubbed):
            self._host.release(scrubbed)

    def release(self, claimed: Iterable[PageEntry]) -> None:
        """Give up claims whose move did not happen (or failed): the pages stay as they were,
        except those doomed meanwhile, whose copies go now."""
        for c in claimed:
            doomed = self._table.settle(c.meta.hash)
            if doomed is not None:
                self.destroy([doomed])

    def drop(self, pages: Iterable[PageHash]) -> list[PageHash]:
        """Remove pages from every tier now (pages being moved go when their move settles).
        Returns the pages that were present: gone for every reader from now on."""
        removed, gone = self._table.remove(pages)
        self.destroy(removed)
        self._counters.count("pages_dropped", n=len(gone))
        return gone

    def detach(self, pages: Iterable[PageHash]) -> tuple[list[PageEntry], list[PageHash]]:
        """The first half of an erasure: out of the table, and their host slots zeroed under new
        generations at once; files and rows stay until `destroy` (after the caller's metadata
        commit). An engine checks its copies by the slots' generations alone, without asking the
        store (`engine_patch.connector.worker_side`), so a slot must move on the moment its page
        leaves the table: a copy taken from then on is refused, as the store would refuse it.
        Zeroing before the commit loses nothing: a failed erasure (`abandon`) frees the host slots
        too, and recovery reads the files. A page being moved (a write-back) is not detached: its
        mover deletes its copies when it settles, which the eraser waits for."""
        removed, gone = self._table.remove(pages)
        for e in removed:
            if e.host_ref is not None:
                self.free_slot(e.meta.hash, e.serial, e.host_ref)
                e.host_ref = None
        self._counters.count("pages_dropped", n=len(gone))
        return removed, gone

    def destroy(self, entries: list[PageEntry], extra_disk: bool = False, rows_deleted: bool = False) -> None:
        """Delete the copies of entries that are out of the table: database rows first (unless
        the caller deleted them), then zeroing slots and unlinking files. `extra_disk`: a disk
        file was written for them that the entries do not list yet."""
        try:
            on_disk = [e.meta.hash for e in entries if extra_disk or Tier.DISK in e.tiers]
            if on_disk and not rows_deleted:
                self._rows.delete(on_disk)
            for e in entries:
                if e.host_ref is not None:
                    self.free_slot(e.meta.hash, e.serial, e.host_ref)
                if self._disk is not None and (extra_disk or Tier.DISK in e.tiers):
                    self._disk.delete(e.meta.hash)
        finally:
            self._table.deleted(e.meta.hash for e in entries)

    def abandon(self, entries: list[PageEntry]) -> None:
        """Detached entries whose files stay (the operation that detached them failed): their
        hashes may be stored again. Their host slots went at `detach`; files stay for recovery."""
        self._table.deleted(e.meta.hash for e in entries)
