"""The page table and its tiers (host arena, disk) against a plain-dict model, driven by hypothesis.

`TieredPages` over a real `PageTable`, `HostTier` and `DiskTier` (a few pages each, so puts evict
and write back), rules for put / write-through / pin / unpin / lease / unlease / demote / promote /
drop. The model is `{page: bytes}` of the pages that are stored somewhere; a page leaves it only
when the store says it is gone (dropped, or evicted from the last tier: the `gone` lists). After
every step `TieredPages.check()` holds and the present pages are exactly the model's; a page that
is read back (leased, promoted to the host, read from its slot) has the bytes it was put with.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path
from typing import ClassVar

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, upgrade_to_head
from dss.errors import CapacityError
from dss.pages.codec import DEFAULT_CODEC, make_codec
from dss.pages.eviction import make_policy
from dss.pages.meta import PageMeta
from dss.pages.placement import TieredPages
from dss.pages.rows import PageRows
from dss.pages.table import Held, PageTable
from dss.pages.tiers.disk import DiskTier
from dss.pages.tiers.host import HostTier
from dss.types import FingerprintId, NamespaceId, PageHash, TenantId, Tier

PAGE_NBYTES = 4096
HOST_PAGES = 3  # small enough that puts evict from the host
DISK_PAGES = 4  # and that the disk evicts too (a page leaves every tier: `gone`)
PAGES = [PageHash(bytes([i]) * 32) for i in range(8)]
TENANT = TenantId("t-statemachine")
KEY = bytes(range(32))


def page_bytes(page: PageHash, version: int) -> bytes:
    """Incompressible bytes (so disk sizes are predictable), different per page and put."""
    rng = np.random.default_rng(page[0] * 1000 + version)
    return rng.integers(0, 256, PAGE_NBYTES, dtype=np.uint8).tobytes()


def meta_of(page: PageHash) -> PageMeta:
    return PageMeta(
        hash=page,
        namespace=NamespaceId(b"\0" * 16),
        tenant=TENANT,
        fingerprint=FingerprintId("fp-statemachine"),
        parent=PageHash(b"\0" * 32),
        index=page[0],
        nbytes=PAGE_NBYTES,
        tokens=np.arange(4, dtype=np.int32),
    )


class PagesMachine(RuleBasedStateMachine):
    factory: ClassVar[sessionmaker[Session] | None] = None

    def __init__(self) -> None:
        super().__init__()
        assert self.factory is not None
        self.root = Path(tempfile.mkdtemp(prefix="dss-pages-sm-"))
        self.host = HostTier(HOST_PAGES * PAGE_NBYTES, directory=self.root / "shm")
        # Room for DISK_PAGES page files (a page file is the page plus a small header).
        self.disk = DiskTier(
            self.root / "disk", DISK_PAGES * (PAGE_NBYTES + 512), make_codec(DEFAULT_CODEC), fsync=False
        )
        # Examples share one database; a server id of their own keeps their rows apart.
        rows = PageRows(self.factory, DEFAULT_CODEC, uuid.uuid4().hex[:16])
        self.pages = TieredPages(
            PageTable(), self.host, self.disk, make_policy("lru"), rows, lambda _tenant: KEY
        )
        self.model: dict[PageHash, bytes] = {}
        self.puts = 0
        self.pinned: set[PageHash] = set()
        self.leases: list[list[Held]] = []

    def teardown(self) -> None:
        for held in self.leases:
            self.pages.unlease(held)
        self.host.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def forget(self, gone: list[PageHash]) -> None:
        for page in gone:
            assert page not in self.pinned or not self.pages.table.contains(page), "a pinned page gone"
            self.model.pop(page, None)

    # ------------------------------------------------------------------ rules
    @rule(page=st.sampled_from(PAGES))
    def put(self, page: PageHash) -> None:
        if page in self.model:
            return  # pages are content-addressed: a present page is never written twice
        gone: list[PageHash] = []
        try:
            ref = self.pages.reserve_host(PAGE_NBYTES, gone)
        except CapacityError:
            assert all(p in self.pinned or self.leased(p) for p in self.on_host()), "full of movable pages"
            self.forget(gone)
            return
        self.forget(gone)
        self.puts += 1
        data = page_bytes(page, self.puts)
        self.host.slot_array(ref)[:] = np.frombuffer(data, dtype=np.uint8)
        assert self.pages.publish(meta_of(page), ref)
        self.model[page] = data

    @rule(data=st.data())
    def write_through(self, data: st.DataObject) -> None:
        page = self.pick(data)
        gone: list[PageHash] = []
        was_host_only = self.pages.tiers_of(page) == {Tier.HOST}
        written = self.pages.write_to_disk(page, gone)
        self.forget(gone)
        if written:
            assert was_host_only and Tier.DISK in self.pages.tiers_of(page)

    @rule(page=st.sampled_from(PAGES), pinned=st.booleans())
    def pin(self, page: PageHash, pinned: bool) -> None:
        self.pages.table.set_pinned([page], pinned)
        if pinned and page in self.model:
            self.pinned.add(page)
        else:
            self.pinned.discard(page)

    @rule(page=st.sampled_from(PAGES))
    def lease(self, page: PageHash) -> None:
        held = self.pages.lease_prefix([page])
        assert len(held) == (1 if page in self.model else 0)
        if held:
            self.leases.append(held)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def unlease(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.leases) - 1))
        self.pages.unlease(self.leases.pop(i))

    @rule(data=st.data())
    def demote(self, data: st.DataObject) -> None:
        page = self.pick(data)
        gone: list[PageHash] = []
        before = self.pages.tiers_of(page)
        moved = self.pages.demoter.demote_to_disk([page], gone)
        self.forget(gone)
        if moved:
            assert Tier.HOST in before and self.pages.tiers_of(page) == {Tier.DISK}
            assert page not in self.pinned and not self.leased(page)
        elif page in self.pinned or self.leased(page):
            assert self.pages.tiers_of(page) == before, "a pinned or leased page moved"

    @rule(data=st.data())
    def promote_and_read(self, data: st.DataObject) -> None:
        page = self.pick(data)
        """A reader: lease, bring to the host, copy the slot, unlease."""
        held = self.pages.lease_prefix([page])
        try:
            if page not in self.model:
                assert not held
                return
            gone: list[PageHash] = []
            ref = self.pages.promoter.promote_to_host(page, gone)
            self.forget(gone)
            if ref is None:  # no host room: every slot is pinned or leased
                assert Tier.HOST not in self.pages.tiers_of(page)
                return
            assert self.pages.table.valid_each([(held[0], ref)]) == [True]
            assert self.host.slot_array(ref).tobytes() == self.model[page]
        finally:
            self.pages.unlease(held)

    @rule(page=st.sampled_from(PAGES))
    def drop(self, page: PageHash) -> None:
        gone = self.pages.copies.drop([page])
        assert gone == ([page] if page in self.model else [])
        self.model.pop(page, None)
        self.pinned.discard(page)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def agrees_with_the_model(self) -> None:
        self.pages.check()
        assert {p for p in PAGES if self.pages.table.contains(p)} == set(self.model)
        assert self.host.used_bytes <= HOST_PAGES * PAGE_NBYTES
        assert self.disk.used_bytes <= self.disk.capacity_bytes
        for page in self.pinned:
            assert page in self.model, "a pinned page was evicted"

    # ------------------------------------------------------------------ helpers
    def pick(self, data: st.DataObject) -> PageHash:
        """Mostly a stored page (moves of absent pages are dull), sometimes any."""
        stored = sorted(self.model)
        if stored and data.draw(st.integers(0, 4)):
            return data.draw(st.sampled_from(stored))
        return data.draw(st.sampled_from(PAGES))

    def on_host(self) -> list[PageHash]:
        return [p for p in self.model if Tier.HOST in self.pages.tiers_of(p)]

    def leased(self, page: PageHash) -> bool:
        """Whether a reader holds a lease on the page as it is now: a lease taken before the page
        was dropped and stored again is on the old entry (another serial), not on this one."""
        entry = self.pages.table.get(page)
        return entry is not None and any(
            h.hash == page and h.serial == entry.serial for held in self.leases for h in held
        )


def test_page_table_and_tiers_against_a_dict(tmp_path: Path) -> None:
    url = sqlite_url_for(tmp_path)
    engine = make_engine(url)
    upgrade_to_head(url, engine)
    PagesMachine.factory = make_session_factory(engine)
    try:
        run_state_machine_as_test(
            PagesMachine,
            settings=settings(
                max_examples=50,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        PagesMachine.factory = None
        engine.dispose()


def test_a_lease_on_a_dropped_page_does_not_hold_it_once_stored_again(tmp_path: Path) -> None:
    """The sequence the state machine once shrank to (put, lease, drop, put, demote): the reader's
    lease is on the dropped entry, so the page stored again may be demoted; the model must know
    the lease by entry (serial), as the table does, not by hash."""
    url = sqlite_url_for(tmp_path)
    engine = make_engine(url)
    upgrade_to_head(url, engine)
    PagesMachine.factory = make_session_factory(engine)
    machine = PagesMachine()
    try:
        page = PAGES[0]
        machine.put(page)
        machine.lease(page)
        machine.drop(page)
        machine.put(page)
        assert not machine.leased(page)
        assert machine.pages.demoter.demote_to_disk([page], []) == 1
        machine.agrees_with_the_model()
    finally:
        machine.teardown()
        PagesMachine.factory = None
        engine.dispose()
