"""The page table's events for KV-aware routers (`dss.pages.events`, `PageTable.take_events`).

- The queue: ids 1, 2, 3, ... per fingerprint; bounded, the oldest dropped and counted; a reader
  whose next event was dropped, who names another epoch or who has not read yet gets a resync.
- The table: replaying its events (a resync replaces the view) gives exactly the pages it holds on
  host and on disk, per tier, after any sequence of puts, write-backs, demotions, promotions,
  evictions and drops (the page-table state machine, with a reader that polls between steps and a
  queue small enough to overflow).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, run_state_machine_as_test

from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, upgrade_to_head
from dss.pages.events import PageEventLog
from dss.pages.eviction import PageStats
from dss.pages.meta import PageMeta
from dss.pages.table import PageEntry, PageTable
from dss.types import FingerprintId, NamespaceId, PageHash, TenantId, Tier
from dss.wire import PAGE_REMOVED, PAGE_STORED, PageEvent, PageEventBatch
from tests.dss.pages.test_page_table_statemachine import PagesMachine

FID = FingerprintId("fp-statemachine")


class Holdings:
    """A router's view of one fingerprint: (page, tier) pairs, rebuilt from the events only."""

    def __init__(self) -> None:
        self.epoch = ""
        self.after = 0
        self.held: set[tuple[PageHash, str]] = set()
        self.resyncs = 0

    def apply(self, batch: PageEventBatch) -> None:
        if batch.resync:
            self.resyncs += 1
            self.held.clear()
        for ev in batch.events:
            key = (ev.page, ev.tier)
            if ev.kind == PAGE_STORED:
                assert key not in self.held, "stored twice without a removal"
                self.held.add(key)
            else:
                assert ev.kind == PAGE_REMOVED
                assert key in self.held, "removed without being stored"
                self.held.discard(key)
        if not batch.resync and batch.events:
            assert [e.id for e in batch.events] == list(range(self.after + 1, batch.last_id + 1))
        self.epoch, self.after = batch.epoch, batch.last_id

    def poll(self, table: PageTable, limit: int = 3) -> None:
        while True:
            batch = table.take_events(FID, self.epoch, self.after, limit)
            self.apply(batch)
            if not batch.more:
                return


def held_by(table: PageTable) -> set[tuple[PageHash, str]]:
    return {(e.meta.hash, t.value) for e in table.snapshot() for t in e.tiers if t in (Tier.HOST, Tier.DISK)}


class EventsMachine(PagesMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pages.table.events.cap = 2  # small: some steps overflow it (a counted drop, a resync)
        self.view = Holdings()
        self.view.poll(self.pages.table)

    @invariant()
    def a_reader_of_the_events_holds_what_the_table_holds(self) -> None:
        self.view.poll(self.pages.table)
        assert self.view.held == held_by(self.pages.table)


def test_replayed_events_are_the_tables_host_and_disk_pages(tmp_path: Path) -> None:
    url = sqlite_url_for(tmp_path)
    engine = make_engine(url)
    upgrade_to_head(url, engine)
    PagesMachine.factory = make_session_factory(engine)
    try:
        run_state_machine_as_test(
            EventsMachine,
            settings=settings(
                max_examples=30,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        PagesMachine.factory = None
        engine.dispose()


def _event(page: int) -> PageEvent:
    return PageEvent(0, PAGE_STORED, "host", PageHash(bytes([page]) * 32), None, 0, 4, "t", (1, 2, 3, 4))


def test_ids_are_monotonic_and_the_queue_is_bounded_with_counted_drops() -> None:
    log = PageEventLog(cap=4)
    log.record(FID, [_event(1)])  # not recorded: nobody reads this fingerprint yet
    assert log.last_id(FID) == 0 and not log.recording(FID)
    log.subscribe(FID)
    log.record(FID, [_event(i) for i in range(3)])
    batch = log.since(FID, log.epoch, 0, 10)
    assert batch is not None and [e.id for e in batch.events] == [1, 2, 3] and batch.last_id == 3
    log.record(FID, [_event(i) for i in range(3)])  # ids 4..6; 1 and 2 are dropped
    assert log.dropped(FID) == 2 and log.stats()["events_dropped"] == 2
    after_3 = log.since(FID, log.epoch, 3, 2)
    assert after_3 is not None and [e.id for e in after_3.events] == [4, 5] and after_3.more
    assert log.since(FID, log.epoch, 1, 10) is None, "the reader missed a dropped event: resync"
    assert log.since(FID, "another-epoch", 3, 10) is None, "a restarted store: resync"
    assert log.since(FID, log.epoch, 99, 10) is None, "a cursor from the future: resync"
    tail = log.since(FID, log.epoch, 6, 10)
    assert tail is not None and tail.events == () and tail.last_id == 6 and not tail.more


def test_a_resync_lists_each_page_after_its_parent_with_its_tokens_and_tenant() -> None:
    table = PageTable()
    hashes = [PageHash(bytes([i + 1]) * 32) for i in range(3)]
    root = PageHash(b"\0" * 32)
    for i in (2, 0, 1):  # inserted out of order
        meta = PageMeta(
            hashes[i],
            NamespaceId(b"n" * 16),
            TenantId("tenant-a"),
            FID,
            hashes[i - 1] if i else root,
            i,
            64,
            np.arange(4 * i, 4 * i + 4, dtype=np.int32),
        )
        table.insert(PageEntry(meta, PageStats(0.0, 0, 0.0, i, 64), {Tier.HOST, Tier.REMOTE}))
    first = table.take_events(FID, "", 0)
    assert first.resync and first.last_id == 0
    assert [(e.page, e.parent, e.index, e.tier) for e in first.events] == [
        (hashes[0], None, 0, "host"),
        (hashes[1], hashes[0], 1, "host"),
        (hashes[2], hashes[1], 2, "host"),
    ], "host pages only (the remote tier is the fleet's), parents first, no parent for the first"
    assert first.events[1].tokens == (4, 5, 6, 7) and first.events[0].tenant == "tenant-a"
    table.remove([hashes[2]])
    after = table.take_events(FID, first.epoch, first.last_id)
    assert not after.resync
    assert [(e.kind, e.page, e.id) for e in after.events] == [(PAGE_REMOVED, hashes[2], 1)]
    assert table.take_events(FID, "a-store-before-a-restart", after.last_id).resync
    assert table.take_events(FingerprintId("other"), first.epoch, 0).events == ()
