"""The shared-memory host tier: slots, capacity, zeroing on delete, and a real second process."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import resource
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dss.errors import CapacityError, InvalidInput, PageMissing, StoreClosed
from dss.pages.tiers.base import PageTier
from dss.pages.tiers.host import HostArena, HostTier, arena_layout
from dss.types import PageHash, Tier
from dss.wire import ArenaInfo, SlotRef

SLOT = 4096


def h(i: int) -> PageHash:
    return PageHash(i.to_bytes(32, "big"))


def page_bytes(i: int, n: int = SLOT) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[HostTier]:
    t = HostTier(8 * SLOT, directory=tmp_path / "shm", pin_memory=False)
    yield t
    t.close()


def test_put_get_delete_and_capacity(tier: HostTier) -> None:
    assert isinstance(tier, PageTier) and tier.tier is Tier.HOST
    refs = [tier.put(h(i), page_bytes(i)) for i in range(8)]
    assert tier.used_bytes == 8 * SLOT and tier.free_bytes == 0
    assert len({r.slot for r in refs}) == 8
    for i in range(8):
        assert bytes(tier.get(h(i))) == page_bytes(i)
    assert tier.put(h(3), page_bytes(3)) == refs[3]  # same page again: a no-op
    with pytest.raises(CapacityError):
        tier.put(h(99), page_bytes(99))
    assert tier.delete(h(2)) == SLOT
    assert tier.delete(h(2)) == 0
    assert not tier.contains(h(2))
    with pytest.raises(PageMissing):
        tier.get(h(2))
    ref = tier.put(h(99), page_bytes(99))
    assert ref.slot == refs[2].slot  # the freed slot is reused
    assert sorted(tier.keys()) == sorted([h(i) for i in range(8) if i != 2] + [h(99)])
    tier.check()


def test_delete_zeroes_the_slot_in_shared_memory(tier: HostTier, tmp_path: Path) -> None:
    ref = tier.put(h(1), page_bytes(1))
    other = HostArena.attach_info(tier.arena(SLOT).info)  # another mapping of the same file
    assert bytes(other.view(ref.slot)) == page_bytes(1)
    tier.delete(h(1))
    assert not other.numpy(ref.slot).any()
    with open(ref.path, "rb") as f:  # and the file itself holds zeros there
        f.seek(other.data_offset + ref.slot * SLOT)
        assert f.read(SLOT) == bytes(SLOT)
    other.close()
    tier.check()


def test_reserve_publish_release(tier: HostTier) -> None:
    ref = tier.reserve(SLOT)
    assert tier.used_bytes == SLOT and not tier.contains(h(5))
    tier.slot_array(ref).data[:] = page_bytes(5)
    assert tier.publish(h(5), ref) == ref
    assert bytes(tier.get(h(5))) == page_bytes(5)
    # A second writer of the same page: its reservation is released, the first slot kept.
    dup = tier.reserve(SLOT)
    tier.slot_array(dup)[:] = 7
    assert tier.publish(h(5), dup) == ref
    assert tier.used_bytes == SLOT
    assert not tier.arena(SLOT).numpy(dup.slot).any()  # the partial copy was zeroed
    with pytest.raises(InvalidInput):
        tier.publish(h(6), dup)  # no longer reserved
    partial = tier.reserve(SLOT)
    tier.release(partial)
    with pytest.raises(InvalidInput):
        tier.release(partial)
    assert tier.used_bytes == SLOT
    tier.check()


def test_arenas_per_slot_size_share_one_capacity(tmp_path: Path) -> None:
    tier = HostTier(10_000, directory=tmp_path / "shm", pin_memory=False)
    try:
        tier.put(h(1), page_bytes(1, 4000))
        tier.put(h(2), page_bytes(2, 3000))
        assert tier.arena(4000).info != tier.arena(3000).info
        assert tier.used_bytes == 7000
        with pytest.raises(CapacityError):
            tier.put(h(3), page_bytes(3, 4000))
        tier.put(h(3), page_bytes(3, 3000))
        with pytest.raises(CapacityError):
            tier.put(h(4), page_bytes(4, 20_000))  # larger than the whole tier
        tier.check()
    finally:
        tier.close()
    assert not (tmp_path / "shm").exists() or not any((tmp_path / "shm").iterdir())


def test_close_unlinks_default_directory() -> None:
    tier = HostTier(4 * SLOT, pin_memory=False)
    tier.put(h(1), page_bytes(1))
    path = Path(tier.arena(SLOT).info.path)
    assert path.exists() and path.parent.name.startswith(f"dss-{os.getpid()}-")
    view = tier.get(h(1))  # a live view must not make close() fail
    tier.close()
    assert not path.exists() and not path.parent.exists()
    assert len(view) == SLOT
    with pytest.raises(StoreClosed):
        tier.put(h(2), page_bytes(2))


def test_arena_bounds_and_attach_checks(tmp_path: Path) -> None:
    arena = HostArena.create(tmp_path / "a.shm", 128, 4)
    try:
        assert os.stat(arena.path).st_size == arena_layout(128, 4)[1] == 4096 + 512  # header page + slots
        assert os.stat(arena.path).st_mode & 0o777 == 0o600
        with pytest.raises(InvalidInput):
            arena.numpy(4)
        with pytest.raises(InvalidInput):
            HostArena.attach(arena.path, 128, 5)
        t = arena.torch(2)
        t.fill_(9)
        assert bytes(arena.view(2)) == b"\x09" * 128 and not arena.numpy(1).any()
        assert pickle.loads(pickle.dumps(arena.info)) == arena.info
    finally:
        arena.close()
        arena.unlink()


def test_concurrent_puts_and_deletes(tier: HostTier) -> None:
    errors: list[BaseException] = []

    def worker(base: int) -> None:
        try:
            for _ in range(30):
                for i in range(base, base + 2):
                    tier.put(h(i), page_bytes(i))
                    assert bytes(tier.get(h(i))) == page_bytes(i)
                for i in range(base, base + 2):
                    assert tier.delete(h(i)) == SLOT
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(10 * k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert tier.used_bytes == 0
    tier.check()


def _child(info: ArenaInfo, read_slot: int, write_slot: int, payload: bytes, conn: object) -> None:
    arena = HostArena.attach_info(info)
    got = bytes(arena.view(read_slot))
    arena.numpy(write_slot)[:] = np.frombuffer(payload, dtype=np.uint8)
    arena.close()
    conn.send(got)  # type: ignore[attr-defined]
    conn.close()  # type: ignore[attr-defined]


def test_second_process_reads_and_writes_slots(tier: HostTier) -> None:
    parent_ref = tier.put(h(1), page_bytes(1))
    child_ref = tier.reserve(SLOT)
    child_payload = page_bytes(2)
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_child, args=(tier.arena(SLOT).info, parent_ref.slot, child_ref.slot, child_payload, send)
    )
    proc.start()
    got = recv.recv() if recv.poll(60) else None
    proc.join(60)
    assert proc.exitcode == 0
    assert got == page_bytes(1)
    assert tier.publish(h(2), child_ref) == child_ref
    assert bytes(tier.get(h(2))) == child_payload
    assert isinstance(child_ref, SlotRef) and pickle.loads(pickle.dumps(child_ref)) == child_ref
    tier.check()


def _faults_writing(arena: HostArena, slots: range) -> int:
    """Page faults this thread takes writing those slots whole."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for s in slots:
        arena.numpy(s)[:] = 1
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_prefault_maps_every_slot_without_changing_a_byte(tmp_path: Path) -> None:
    """Before: a process's first write to each 4 KiB of a slot was a page fault; the engine's
    worker spent 120-180 ms of an engine step in them for a new 2,000-token prompt's pages."""
    slot, n = 1 << 20, 8
    owner = HostArena.create(tmp_path / "a.shm", slot, n)
    owner.numpy(0)[:] = 7
    lazy = HostArena.attach(tmp_path / "a.shm", slot)  # as another process (the engine) maps it
    eager = HostArena.attach(tmp_path / "a.shm", slot)
    try:
        assert _faults_writing(lazy, range(1, 4)) >= 3 * slot // 4096  # the measurement works here
        if not eager.prefault():
            pytest.skip("the kernel takes no MADV_POPULATE_WRITE (Linux < 5.14)")
        assert _faults_writing(eager, range(4, 8)) < 64
        assert (eager.numpy(0) == 7).all() and (owner.numpy(1) == 1).all()  # bytes as they were
        assert not lazy.prefault(stop=lambda: True)  # asked to stop: maps nothing more
    finally:
        for a in (lazy, eager, owner):
            a.close()
    assert not eager.prefault()  # closed
