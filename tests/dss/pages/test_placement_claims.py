"""Claims never leak: a page's move that fails in an unexpected way (here the data-key lookup
raising what a database error would) still settles the page, so it stays evictable.

Real parts: `TieredPages` over a real `PageTable`, `HostTier`, `DiskTier` and `PageRows` on SQLite.
A page left busy by a failed move is never picked for eviction again: enough of them and the host
tier refuses every save ("host tier is full of pages in use or pinned"). `check()` fails on a busy
page at rest, so every test ends with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, upgrade_to_head
from dss.pages.codec import DEFAULT_CODEC, make_codec
from dss.pages.eviction import make_policy
from dss.pages.meta import PageMeta
from dss.pages.placement import TieredPages
from dss.pages.rows import PageRows
from dss.pages.table import PageTable
from dss.pages.tiers.disk import DiskTier
from dss.pages.tiers.host import HostTier
from dss.types import FingerprintId, NamespaceId, PageHash, TenantId, Tier

PAGE_NBYTES = 4096
HOST_PAGES = 3
TENANT = TenantId("t-claims")
KEY = bytes(range(32))


class FlakyKeys:
    """The data-key lookup; raises `failures` times first (a stand-in for a database error)."""

    def __init__(self) -> None:
        self.failures = 0

    def __call__(self, _tenant: TenantId) -> bytes:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("database is locked")
        return KEY


@pytest.fixture
def keys() -> FlakyKeys:
    return FlakyKeys()


@pytest.fixture
def pages(tmp_path: Path, keys: FlakyKeys) -> Iterator[TieredPages]:
    url = sqlite_url_for(tmp_path)
    engine = make_engine(url)
    upgrade_to_head(url, engine)
    host = HostTier(HOST_PAGES * PAGE_NBYTES, directory=tmp_path / "shm")
    disk = DiskTier(tmp_path / "disk", 16 * (PAGE_NBYTES + 512), make_codec(DEFAULT_CODEC), fsync=False)
    rows = PageRows(make_session_factory(engine), DEFAULT_CODEC, "claims")
    yield TieredPages(PageTable(), host, disk, make_policy("lru"), rows, keys)
    host.close()
    engine.dispose()


def ph(i: int) -> PageHash:
    return PageHash(bytes([i]) * 32)


def put(pages: TieredPages, i: int) -> PageHash:
    gone: list[PageHash] = []
    ref = pages.reserve_host(PAGE_NBYTES, gone)
    rng = np.random.default_rng(i)
    pages.host.slot_array(ref)[:] = rng.integers(0, 256, PAGE_NBYTES, dtype=np.uint8)
    meta = PageMeta(
        hash=ph(i),
        namespace=NamespaceId(b"\0" * 16),
        tenant=TENANT,
        fingerprint=FingerprintId("fp-claims"),
        parent=PageHash(b"\0" * 32),
        index=i,
        nbytes=PAGE_NBYTES,
        tokens=np.arange(4, dtype=np.int32),
    )
    assert pages.publish(meta, ref)
    return ph(i)


def test_a_failed_write_through_settles_the_page(pages: TieredPages, keys: FlakyKeys) -> None:
    page = put(pages, 1)
    keys.failures = 1
    assert pages.write_to_disk(page, []) is False  # not written: it stays in memory
    assert pages.tiers_of(page) == {Tier.HOST}
    assert pages.counters.disk_write_errors == 1
    pages.check()  # not busy
    assert pages.write_to_disk(page, []) is True  # tried again later, it is written
    pages.check()


def test_a_failed_demotion_on_request_settles_the_page(pages: TieredPages, keys: FlakyKeys) -> None:
    page = put(pages, 1)
    keys.failures = 1
    assert pages.demoter.demote_to_disk([page], []) == 0  # never loses a page: it stays on the host
    assert pages.tiers_of(page) == {Tier.HOST}
    pages.check()
    assert pages.demoter.demote_to_disk([page], []) == 1
    assert pages.tiers_of(page) == {Tier.DISK}
    pages.check()


def test_a_failed_write_back_while_making_room_leaves_the_host_usable(
    pages: TieredPages, keys: FlakyKeys
) -> None:
    first = [put(pages, i) for i in range(1, HOST_PAGES + 1)]  # the host is full of host-only pages
    keys.failures = 1  # the victim's write-back fails: it is evicted without a disk copy
    gone: list[PageHash] = []
    ref = pages.reserve_host(PAGE_NBYTES, gone)
    pages.release_host(ref)
    assert gone == [first[0]] and not pages.table.contains(first[0])
    pages.check()
    for i in range(10, 10 + 2 * HOST_PAGES):  # every page evictable still: saves go on
        put(pages, i)
    pages.check()


def test_a_failed_promotion_settles_the_page(pages: TieredPages, keys: FlakyKeys) -> None:
    page = put(pages, 1)
    assert pages.demoter.demote_to_disk([page], []) == 1
    keys.failures = 1
    held = pages.lease_prefix([page])
    try:
        assert pages.promoter.promote_to_host(page, []) is None  # not had now: the engine recomputes it
    finally:
        pages.unlease(held)
    assert pages.tiers_of(page) == {Tier.DISK}
    pages.check()  # not busy, and no host slot left reserved for it
    held = pages.lease_prefix([page])
    try:
        assert pages.promoter.promote_to_host(page, []) is not None
    finally:
        pages.unlease(held)
    assert pages.tiers_of(page) == {Tier.HOST, Tier.DISK}
    pages.check()


def test_failed_write_throughs_leave_every_page_evictable(pages: TieredPages, keys: FlakyKeys) -> None:
    """What a full CI run once saw: the background writer survives a failed write-through (it logs
    and goes on), but a page left claimed is never evicted; a host tier of such pages refuses every
    save with `CapacityError` ("host tier is full of pages in use or pinned")."""
    first = [put(pages, i) for i in range(1, HOST_PAGES + 1)]
    keys.failures = HOST_PAGES
    assert [pages.write_to_disk(p, []) for p in first] == [False] * HOST_PAGES
    put(pages, 99)  # room is made: a page not written through is evicted, not stuck
    pages.check()
