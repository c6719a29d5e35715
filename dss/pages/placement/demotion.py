"""Demotion on request: moving pages off the host tier onto the disk tier (for `dss.ops.retention`:
`evict` sessions and idle ones).

Unlike eviction it never loses a page: a page stays on the host when it is leased, pinned (a
public prefix's pin, or the `PINNED` retention class: such a page stays where it is for everyone),
being moved, or cannot be written to disk (no disk tier, disk unavailable or full, the write
failed). Each page is claimed, written back when only the host has it (no lock held), settled,
and only then its host slot freed. A page whose bytes fail their checksum is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

from dss.pages.eviction import RetentionClass
from dss.pages.placement.copies import PageCopies
from dss.pages.placement.counters import TierCounters
from dss.pages.placement.writer import CORRUPT, PageWriter
from dss.pages.table import PageEntry, PageTable
from dss.types import PageHash, Tier


class Demoter:
    def __init__(
        self, table: PageTable, writer: PageWriter | None, copies: PageCopies, counters: TierCounters
    ) -> None:
        self._table = table
        self._writer = writer  # None: no disk tier, nothing is demoted
        self._copies = copies
        self._counters = counters

    def demote_to_disk(self, pages: Iterable[PageHash], gone: list[PageHash]) -> int:
        """Move these pages off the host tier onto the disk tier (written back first when only
        the host has them); returns how many left the host. Pages that fail their checksum are
        dropped (appended to `gone`)."""
        if self._writer is None:
            return 0
        moved = 0
        for page in pages:
            claimed = self._table.claim(page, _demotable)
            if claimed is None:
                continue
            written = 0
            if Tier.DISK not in claimed.tiers:
                written = self._writer.write_claimed(claimed, gone)
                if written <= 0:  # stays where it was (or goes, doomed or corrupt)
                    doomed = self._table.settle(page)
                    if doomed is not None:
                        self._copies.destroy([doomed])
                    elif written == CORRUPT:
                        self._counters.count("corrupt_pages")
                        gone.extend(self._copies.drop([page]))
                    continue

            def off_host(e: PageEntry, written: int = written) -> None:
                if written:
                    e.tiers.add(Tier.DISK)
                    e.disk_bytes = written
                e.tiers.discard(Tier.HOST)
                e.host_ref = None

            ended = self._table.settle(page, off_host)
            if ended is not None:  # doomed while we wrote: every copy goes
                self._copies.destroy([ended], extra_disk=bool(written))
                continue
            assert claimed.host_ref is not None
            self._copies.free_slot(page, claimed.serial, claimed.host_ref)
            moved += 1
        if moved:
            self._counters.count("demoted_pages", n=moved)
        return moved


def _demotable(e: PageEntry) -> bool:
    """The claim test (called under the table's lock): on the host, unleased, unpinned."""
    return (
        Tier.HOST in e.tiers
        and e.leases == 0
        and not e.stats.pinned
        and e.stats.retention is not RetentionClass.PINNED
    )
