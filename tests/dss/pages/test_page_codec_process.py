"""The page codec helper process: page files it writes and reads are the disk tier's own format,
failures come back typed, and a helper that dies is replaced (or the work runs in-process)."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dss.errors import CorruptPage, PageMissing, TierUnavailable
from dss.pages.codec import make_codec
from dss.pages.encoder import PageCodecProcess
from dss.pages.tiers.disk import DiskTier
from dss.pages.tiers.host import HostTier
from tests.dss.pages.test_tier_disk import bf16_page, make_meta

KEY = bytes(range(32))


@pytest.fixture
def parts(tmp_path: Path) -> Iterator[tuple[PageCodecProcess, HostTier, DiskTier]]:
    codec = PageCodecProcess("zstd-byteplane")
    host = HostTier(1 << 20, directory=tmp_path / "shm", pin_memory=False)
    disk = DiskTier(tmp_path / "pages", 1 << 24, make_codec("zstd-byteplane"), fsync=True)
    try:
        yield codec, host, disk
    finally:
        codec.close()
        host.close()


def test_helper_files_are_the_disk_tiers_format(parts: tuple[PageCodecProcess, HostTier, DiskTier]) -> None:
    codec, host, disk = parts
    raw = bf16_page(1)
    meta = make_meta(1, raw)
    meta.checksum = b""
    src = host.reserve(len(raw))
    host.slot_array(src)[:] = np.frombuffer(raw, dtype=np.uint8)
    tmp = disk.temp_path(meta.hash)
    size = codec.encode_to_file(meta, src, KEY, tmp, fsync=True)
    assert meta.checksum  # set from the helper's answer
    assert disk.adopt(meta, tmp, size) == size and disk.contains(meta.hash)
    _, _, back = disk.read(meta.hash, KEY)  # read here: the same format
    assert bytes(back) == raw
    dst = host.reserve(len(raw))
    codec.decode_file(disk.path_of(meta.hash), meta.hash, KEY, dst)  # decoded in the helper
    assert host.slot_array(dst).tobytes() == raw


def test_helper_failures_are_typed(parts: tuple[PageCodecProcess, HostTier, DiskTier]) -> None:
    codec, host, disk = parts
    raw = bf16_page(2)
    meta = make_meta(2, raw)
    disk.write(meta, raw, KEY)
    dst = host.reserve(len(raw))
    with pytest.raises(CorruptPage):  # another key: authentication fails
        codec.decode_file(disk.path_of(meta.hash), meta.hash, bytes(32), dst)
    with pytest.raises(PageMissing):
        codec.decode_file(disk.path_of(meta.hash).with_name("gone.page"), meta.hash, KEY, dst)
    changed = make_meta(2, raw)
    changed.checksum = b"\x01" * 16  # an xxh3-128 that the slot's bytes do not match
    src = host.reserve(len(raw))
    host.slot_array(src)[:] = np.frombuffer(raw, dtype=np.uint8)
    with pytest.raises(CorruptPage):
        codec.encode_to_file(changed, src, KEY, disk.temp_path(meta.hash), fsync=False)


def test_a_helper_that_dies_is_replaced(parts: tuple[PageCodecProcess, HostTier, DiskTier]) -> None:
    codec, host, disk = parts
    raw = bf16_page(3)
    meta = make_meta(3, raw)
    disk.write(meta, raw, KEY)
    dst = host.reserve(len(raw))
    codec.decode_file(disk.path_of(meta.hash), meta.hash, KEY, dst)  # starts a helper
    helpers = [p.pid for p in multiprocessing.active_children() if p.pid is not None]
    assert helpers  # the codec's helpers are this process's only children here
    for pid in helpers:  # as a crash would
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(TierUnavailable):
        codec.decode_file(disk.path_of(meta.hash), meta.hash, KEY, dst)
    codec.decode_file(disk.path_of(meta.hash), meta.hash, KEY, dst)  # a new helper serves
    assert host.slot_array(dst).tobytes() == raw


def _starve_the_helper_start(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every helper takes `seconds` longer to start, as a spawned interpreter's imports did on
    cores that engines spin on."""
    import time

    import dss.pages.encoder as encoder

    real_init = encoder._Worker.__init__

    def starved_start(self: encoder._Worker) -> None:
        time.sleep(seconds)
        real_init(self)

    monkeypatch.setattr(encoder._Worker, "__init__", starved_start)


def test_a_load_after_a_restart_does_not_wait_for_the_helper_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first pages a reopened store reads from disk are decoded in the loading thread while
    the helper starts: a helper's interpreter took over 30 s to start on 2 cores while a TP=2
    engine's processes spun, and the turn after the restart waited out its whole load timeout on
    every rank (issue 31, item 6). Here the start is made 5 s slow; the load finishes first, with
    the right bytes, and the helper serves once it answered."""
    import time

    from tests.store_helpers import SMALL_FP, disk_only_store, load_sequence, open_store

    tokens, pages = disk_only_store(tmp_path)

    slow_start = 5.0
    _starve_the_helper_start(monkeypatch, slow_start)
    store = open_store(tmp_path)
    try:
        fid = store.fingerprints.register(SMALL_FP)
        t0 = time.monotonic()
        n, got = load_sequence(store, fid, store.identity.tenant_for("alice"), tokens)
        took = time.monotonic() - t0
        assert (n, got) == (40, pages)
        assert took < slow_start / 2, f"the load waited {took:.1f} s for the helper to start"
        # Meanwhile a helper was started in the background, for the loads to come.
        deadline = time.monotonic() + 60
        while not any(p.name == "dss-page-codec" for p in multiprocessing.active_children()):
            assert time.monotonic() < deadline, "no page codec helper was started"
            time.sleep(0.2)
    finally:
        store.close()


def test_the_first_page_writes_do_not_wait_for_the_helper_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new store's first write-throughs are encoded in the writer thread while the helper
    starts: a turn's commit waits for them (its durable wait when a remote tier is shared), and
    on a loaded 2-core CI machine that wait ran out behind the helper's start (stop 34's CI:
    tests/dss/ops/kv/test_wait_shared.py). Here the start is made 5 s slow."""
    import time

    from tests.store_helpers import SMALL_FP, open_store, pages_for, put_sequence

    slow_start = 5.0
    _starve_the_helper_start(monkeypatch, slow_start)
    store = open_store(tmp_path)
    try:
        fid = store.fingerprints.register(SMALL_FP)
        tokens = np.arange(1, 41, dtype=np.int32)  # 10 pages
        pages = pages_for(SMALL_FP, tokens)
        t0 = time.monotonic()
        assert put_sequence(store, fid, store.identity.tenant_for("alice"), tokens, pages) == 10
        assert store.flush()
        took = time.monotonic() - t0
        assert took < slow_start / 2, f"the writes waited {took:.1f} s for the helper to start"
        assert store.disk is not None and len(list(store.disk.scan())) == 10
    finally:
        store.close()
