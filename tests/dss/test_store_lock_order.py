"""Deterministic regressions for the disk writer versus lookups (lock order, lock scope).

The interleaving is forced with events: the call that encodes and writes a page file is wrapped on
the instance so that the background write-through of one page stops inside it until the test
releases it: `store.disk.write` when pages are encoded in the owner process, the helper call
`store.pages.encoder.encode_to_file` when a codec process does it (both are run). Only public
behaviour is used (Store methods, `store.disk`, `store.pages.encoder`, `store.kv.lookup.residency`).

1. A lookup of a page that is already in the host tier must not wait for a disk write in
   flight (encode, encrypt, write, fsync can take tens of ms for a real page; lookups must not
   queue behind the write-through backlog).
2. The deadlock shape: the disk tier is full, so the paused write must evict a disk-only page
   (which unlinks it from the tries); a lookup started while the write is paused must not end
   in a deadlock with the writer once the write resumes, and the write must land.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dss.store import Store
from dss.types import TenantId
from tests.store_helpers import (
    DISK_PAGE_FILE_BYTES,
    SMALL_FP,
    call_bounded,
    exit_hard_at_shutdown,
    load_sequence,
    open_store,
    pages_for,
    put_sequence,
    thread_stacks,
)

PAUSE_S = 20.0  # the writer never stays paused longer than this, even if the test dies
LOOKUP_S = 3.0  # a host-resident lookup that takes longer than this is blocked
SETTLE_S = 10.0  # after the writer is released, everything must finish within this
BS = SMALL_FP.block_size
HOT = np.arange(1, 9, dtype=np.int32)  # 2 pages, host-resident
NEW = np.arange(500, 504, dtype=np.int32)  # 1 page, put while the writer is paused on another


class PausedWriter:
    """Wraps the page-file write: the first call once armed signals `entered`, waits for `release`."""

    def __init__(self, store: Store) -> None:
        assert store.disk is not None
        self.target: Any = store.pages.encoder if store.pages.encoder is not None else store.disk
        self.method = "encode_to_file" if store.pages.encoder is not None else "write"
        self._orig = getattr(self.target, self.method)
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed and not self.entered.is_set():
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            self.release.wait(PAUSE_S)
        return self._orig(*args, **kwargs)


Opener = Callable[..., tuple[Store, PausedWriter]]


def _flush(store: Store) -> None:
    flush = store.flush
    finished, _, exc = call_bounded(flush, SETTLE_S)
    assert finished and exc is None, f"flush did not finish ({exc!r})"


@pytest.fixture(params=[False, True], ids=["in-process", "codec-process"])
def paused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[Opener]:
    """Opens the test's store with its page-file write wrapped; on teardown releases and closes it."""
    holder: dict[str, Any] = {}

    def make(**overrides: object) -> tuple[Store, PausedWriter]:
        store = open_store(tmp_path, codec_process=request.param, **overrides)
        pw = PausedWriter(store)
        if store.pages.encoder is not None:  # the writer encodes pages itself until one answered
            assert store.pages.encoder.wait_ready(60), "the page codec process did not start"
        monkeypatch.setattr(pw.target, pw.method, pw)
        holder.update(store=store, pw=pw)
        return store, pw

    yield make
    if "pw" in holder:
        holder["pw"].release.set()
        finished, _, _ = call_bounded(holder["store"].close, SETTLE_S)
        if not finished:
            exit_hard_at_shutdown()  # a deadlocked store would block interpreter exit


def _operations(store: Store, fid: Any, tenant: TenantId) -> dict[str, Callable[[], object]]:
    hot_pages = pages_for(SMALL_FP, HOT)

    def load() -> object:
        n, got = load_sequence(store, fid, tenant, HOT)
        assert n == len(HOT) and got == hot_pages
        return n

    def match() -> object:
        assert store.kv.match(fid, tenant, HOT).n_tokens == len(HOT)
        return True

    return {
        "match": match,
        "load_sequence": load,
        "put_existing": lambda: put_sequence(store, fid, tenant, HOT, hot_pages),
    }


def _pause_writer_on_new_page(store: Store, pw: PausedWriter, fid: Any, tenant: TenantId) -> None:
    pw.armed = True
    # The put itself may (wrongly) block behind the paused writer: run it aside.
    call_bounded(lambda: put_sequence(store, fid, tenant, NEW, pages_for(SMALL_FP, NEW)), 0.0)
    assert pw.entered.wait(LOOKUP_S), f"write-through never reached {pw.method}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["match", "load_sequence", "put_existing"])
def test_host_lookup_does_not_wait_for_disk_write(paused: Opener, op: str) -> None:
    store, pw = paused(fsync=True)
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for("alice")
    put_sequence(store, fid, tenant, HOT, pages_for(SMALL_FP, HOT))
    _flush(store)
    try:
        _pause_writer_on_new_page(store, pw, fid, tenant)
        finished, _, exc = call_bounded(_operations(store, fid, tenant)[op], LOOKUP_S)
        assert finished, (
            f"{op} of a host-resident page blocked for {LOOKUP_S} s while the disk writer "
            f"({pw.threads}) was inside store.disk.write; threads:\n{thread_stacks()}"
        )
        if exc is not None:
            raise exc
    finally:
        pw.release.set()
    _flush(store)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["match", "load_sequence", "put_existing"])
def test_evicting_disk_write_and_lookup_do_not_deadlock(paused: Opener, op: str) -> None:
    # host: 4 pages; disk: 6 page files (6.5 x the measured size, so a 7th does not fit)
    store, pw = paused(
        fsync=True,
        host_capacity_bytes=4 * SMALL_FP.page_nbytes,
        disk_capacity_bytes=int(6.5 * DISK_PAGE_FILE_BYTES),
    )
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for("alice")
    for base in (100, 200, 300):  # 2-page sequences: the first one ends up disk-only
        toks = np.arange(base, base + 8, dtype=np.int32)
        put_sequence(store, fid, tenant, toks, pages_for(SMALL_FP, toks))
        _flush(store)
    put_sequence(store, fid, tenant, HOT, pages_for(SMALL_FP, HOT))
    _flush(store)
    disk = store.disk
    assert disk is not None
    per_page = disk.used_bytes / max(1, len(list(disk.keys())))
    assert disk.used_bytes + per_page > disk.capacity_bytes, "precondition: the disk tier is full"
    assert store.kv.lookup.residency(fid, tenant, HOT)["host"] == len(HOT), (
        "precondition: HOT is in the host tier"
    )

    try:
        _pause_writer_on_new_page(store, pw, fid, tenant)
        # Start the lookup while the writer is paused (it may or may not finish before release).
        result: dict[str, tuple[bool, object, BaseException | None]] = {}
        t = threading.Thread(
            target=lambda: result.update(r=call_bounded(_operations(store, fid, tenant)[op], 2 * SETTLE_S)),
            daemon=True,
        )
        t.start()
        t.join(LOOKUP_S)
    finally:
        pw.release.set()
    t.join(SETTLE_S)
    lookup = result.get("r", (False, None, None))
    assert lookup[0], (
        f"deadlock: {op} (started while the evicting disk write was paused) still blocked "
        f"{SETTLE_S} s after the writer was released; threads:\n{thread_stacks()}"
    )
    if lookup[2] is not None:
        raise lookup[2]
    _flush(store)
    finished, res, exc = call_bounded(lambda: store.kv.match(fid, tenant, NEW).pages, SETTLE_S)
    assert finished and exc is None, f"match hung or failed after the write resumed ({exc!r})"
    assert isinstance(res, tuple) and len(res) == 1, f"NEW is not indexed: {res}"
    assert disk.contains(res[0]), "the evicting write did not land on disk"
    assert disk.used_bytes <= disk.capacity_bytes
    finished, _, exc = call_bounded(store.check, SETTLE_S)
    assert finished and exc is None, f"store.check() hung or failed ({exc!r})"
