"""The shared-memory host arena against other local users, a small /dev/shm, and slot reuse.

1. Paths: every tier makes its own directory under an unguessable name, exclusively, 0700; a
   directory or symlink another user planted (at the name the store used to derive from its data
   directory, or as the base) is never used; every attach (the engine's worker, the codec
   helpers) refuses symlinks and files or directories that are not ours and private.
2. Space: the arena is reserved in full when made (`posix_fallocate`), so a /dev/shm too small
   for the configured capacity is a clear refusal to start, never a SIGBUS on a later write.
   Tested on a real 8 MiB tmpfs (we run as root; skipped when the mount is not allowed).
3. Slot generations and leases: a slot's generation moves on before its bytes change, a reader
   checks it after copying, and a slot whose page is leased is not reused until the lease ends:
   a load holding a slot while the page is dropped and another tenant's page is saved never
   delivers that other page's bytes.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dss import errors
from dss.errors import TierUnavailable
from dss.pages.codec import make_codec
from dss.pages.encoder import PageCodecProcess
from dss.pages.tiers.disk import DiskTier
from dss.pages.tiers.host import HostArena, HostTier
from dss.store import Store
from dss.types import PageHash
from dss.wire import SlotRef
from engine_patch.connector.copy import ArenaViews
from tests.dss.pages.test_tier_disk import bf16_page, make_meta
from tests.paths import REPO
from tests.store_helpers import SMALL_FP, open_store, pages_for, put_sequence

SLOT = 4096
MiB = 1 << 20
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="planting another user's files needs root")


def h(i: int) -> PageHash:
    return PageHash(i.to_bytes(32, "big"))


def nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


def foreign_dir(path: Path, mode: int = 0o777) -> Path:
    """A directory another local user owns (and may write in)."""
    path.mkdir(parents=True)
    os.chown(path, nobody(), nobody())
    os.chmod(path, mode)
    return path


def _raised(call: Callable[[], object]) -> BaseException | None:
    try:
        call()
    except BaseException as exc:
        return exc
    return None


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)
    return path


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs, mounted like /dev/shm (root-owned, sticky, world-writable)."""
    mnt = tmp_path / "small-shm"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=1777", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ---------------------------------------------------------------------------------------- 1. paths
def test_each_tier_makes_a_fresh_private_directory_with_an_unguessable_name(tmp_path: Path) -> None:
    base = tmp_path / "shm"
    a = HostTier(4 * SLOT, directory=base, pin_memory=False)
    b = HostTier(4 * SLOT, directory=base, pin_memory=False)
    try:
        assert a.directory != b.directory
        for tier in (a, b):
            assert tier.directory.parent == base, "the tier must make its own directory, not use the base"
            random_part = tier.directory.name.rsplit("-", 1)[-1]
            assert len(random_part) >= 32 and int(random_part, 16) >= 0  # 128 random bits
            st = os.lstat(tier.directory)
            assert (st.st_uid, st.st_mode & 0o7777) == (os.geteuid(), 0o700)
            ref = tier.put(h(1), bytes(SLOT))
            st = os.lstat(ref.path)
            assert Path(ref.path).parent == tier.directory
            assert (st.st_uid, st.st_mode & 0o7777) == (os.geteuid(), 0o600)
    finally:
        a.close()
        b.close()
    assert list(base.iterdir()) == []


@needs_root
def test_a_symlink_planted_at_the_old_predictable_store_path_is_never_followed(tmp_path: Path) -> None:
    """The store used `/dev/shm/dss-<blake2b of data_dir>`: any local user could compute it and
    plant a symlink there; `rmtree(ignore_errors=True)` left the symlink, `mkdir(exist_ok=True)`
    accepted it, and every user's KV was written into the attacker's directory."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    data = tmp_path / "data"
    old_name = hashlib.blake2b(str(data.resolve()).encode(), digest_size=6).hexdigest()
    planted = Path("/dev/shm") / f"dss-{old_name}"
    attacker = foreign_dir(tmp_path / "attacker")
    planted.symlink_to(attacker)
    try:
        store = open_store(data)
        try:
            fid = store.fingerprints.register(SMALL_FP)
            tokens = np.arange(1, 9, dtype=np.int32)
            put_sequence(store, fid, store.identity.tenant_for("alice"), tokens, pages_for(SMALL_FP, tokens))
            arena_dir = store.host.directory
            assert arena_dir.resolve() != attacker.resolve() and arena_dir != planted
        finally:
            store.close()
        assert list(attacker.iterdir()) == [], "KV pages went into a directory another user planted"
    finally:
        planted.unlink()


@needs_root
def test_a_base_directory_other_users_control_is_refused(tmp_path: Path) -> None:
    open_to_all = foreign_dir(tmp_path / "planted")  # another user's, 0777, not sticky
    with pytest.raises(TierUnavailable):
        HostTier(4 * SLOT, directory=open_to_all, pin_memory=False)
    link = tmp_path / "link"
    link.symlink_to(open_to_all)
    with pytest.raises(TierUnavailable):
        HostTier(4 * SLOT, directory=link, pin_memory=False)
    assert list(open_to_all.iterdir()) == []


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[HostTier]:
    t = HostTier(8 * SLOT, directory=tmp_path / "shm", pin_memory=False)
    yield t
    t.close()


def test_attach_refuses_a_symlink_to_an_arena(tier: HostTier, tmp_path: Path) -> None:
    ref = tier.reserve(SLOT)
    links = _private_dir(tmp_path / "links")
    link = links / "arena.shm"
    link.symlink_to(ref.path)
    with pytest.raises(TierUnavailable, match="symbolic link"):
        HostArena.attach(link, SLOT, ref.n_slots)
    assert isinstance(_raised(lambda: HostArena.attach(link, SLOT, ref.n_slots)), errors.UnsafeSharedMemory)
    # The engine worker's views and the codec helpers attach through the same checks.
    views = ArenaViews(1, SLOT)
    try:
        with pytest.raises(TierUnavailable):
            views.pages(str(link), SLOT)
    finally:
        views.close()
    dir_link = tmp_path / "dir-link"
    dir_link.symlink_to(tier.directory)
    with pytest.raises(TierUnavailable):
        HostArena.attach(dir_link / Path(ref.path).name, SLOT, ref.n_slots)


def test_attach_refuses_files_and_directories_open_to_others(tier: HostTier) -> None:
    ref = tier.reserve(SLOT)
    path = Path(ref.path)
    HostArena.attach(path, SLOT, ref.n_slots).close()  # as made: accepted
    os.chmod(path, 0o644)
    with pytest.raises(TierUnavailable, match="mode"):
        HostArena.attach(path, SLOT, ref.n_slots)
    os.chmod(path, 0o600)
    os.chmod(tier.directory, 0o755)
    with pytest.raises(TierUnavailable, match="mode"):
        HostArena.attach(path, SLOT, ref.n_slots)
    os.chmod(tier.directory, 0o700)
    fifo = tier.directory / "fifo.shm"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(TierUnavailable, match="regular file"):
        HostArena.attach(fifo, SLOT, 1)  # refused before it is opened: a FIFO open could block
    fifo.unlink()


@needs_root
def test_attach_refuses_another_users_file(tier: HostTier) -> None:
    ref = tier.reserve(SLOT)
    os.chown(ref.path, nobody(), nobody())
    try:
        with pytest.raises(TierUnavailable, match="uid"):
            HostArena.attach(ref.path, SLOT, ref.n_slots)
    finally:
        os.chown(ref.path, os.geteuid(), os.getegid())


def test_the_codec_helper_refuses_a_symlinked_arena(tmp_path: Path) -> None:
    raw = bf16_page(1)
    big = HostTier(1 << 20, directory=tmp_path / "shm2", pin_memory=False)
    codec = PageCodecProcess("zstd-byteplane")
    disk = DiskTier(tmp_path / "pages", 1 << 24, make_codec("zstd-byteplane"), fsync=False)
    try:
        src = big.reserve(len(raw))
        big.slot_array(src)[:] = np.frombuffer(raw, dtype=np.uint8)
        link = _private_dir(tmp_path / "links") / "arena.shm"
        link.symlink_to(src.path)
        meta = make_meta(1, raw)
        with pytest.raises(TierUnavailable, match="symbolic link"):  # raised in the helper process
            codec.encode_to_file(meta, replace(src, path=str(link)), None, disk.temp_path(meta.hash), False)
        size = codec.encode_to_file(meta, src, None, disk.temp_path(meta.hash), False)  # the real path
        assert size > 0
    finally:
        codec.close()
        big.close()


def test_a_crashed_owners_directory_is_removed_by_the_next_one(tmp_path: Path) -> None:
    run = _private_dir(tmp_path / "run")
    record = run / "host-arena-dir"
    crashed = HostTier(4 * SLOT, directory=tmp_path / "shm", pin_memory=False, record=record)
    ref = crashed.put(h(1), b"\x05" * SLOT)
    left = crashed.directory  # never closed: the owner died
    assert Path(ref.path).exists() and record.read_text() == str(left)
    nxt = HostTier(4 * SLOT, directory=tmp_path / "shm", pin_memory=False, record=record)
    try:
        assert not left.exists() and record.read_text() == str(nxt.directory)
    finally:
        nxt.close()
    assert not record.exists() and not nxt.directory.exists()


@needs_root
def test_a_record_never_removes_another_users_directory(tmp_path: Path) -> None:
    run = _private_dir(tmp_path / "run")
    record = run / "host-arena-dir"
    theirs = foreign_dir(tmp_path / "theirs", 0o700)
    (theirs / "keep").write_bytes(b"x")
    record.write_text(str(theirs))
    tier = HostTier(4 * SLOT, directory=tmp_path / "shm", pin_memory=False, record=record)
    tier.close()
    assert (theirs / "keep").exists()


# ---------------------------------------------------------------------------------------- 2. space
def test_a_capacity_beyond_the_free_shared_memory_refuses_to_start(small_shm: Path, tmp_path: Path) -> None:
    with pytest.raises(TierUnavailable) as caught:
        HostTier(16 * MiB, directory=small_shm, pin_memory=False)
    message = str(caught.value)
    assert "\n" not in message
    assert "DSS_STORE__HOST_CAPACITY_BYTES" in message and "host_capacity_bytes" in message
    assert str(os.statvfs(small_shm).f_bavail * os.statvfs(small_shm).f_frsize) in message  # free bytes
    assert isinstance(caught.value, errors.SharedMemoryFull)
    # The store refuses to start with the same message (and can be opened once it fits).
    with pytest.raises(TierUnavailable, match="DSS_STORE__HOST_CAPACITY_BYTES"):
        open_store(tmp_path / "data", shm_dir=small_shm, host_capacity_bytes=16 * MiB)
    open_store(tmp_path / "data", shm_dir=small_shm, host_capacity_bytes=4 * MiB).close()
    assert list(small_shm.iterdir()) == []


def test_an_arena_is_reserved_in_full_when_it_is_made(small_shm: Path) -> None:
    tier = HostTier(4 * MiB, directory=small_shm, pin_memory=False)
    try:
        ref = tier.reserve(MiB)
        st = os.stat(ref.path)
        assert st.st_blocks * 512 >= st.st_size >= 4 * MiB, "the arena is sparse: a later write may SIGBUS"
    finally:
        tier.close()


_FILL_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from dss.errors import TierUnavailable
    from dss.pages.tiers.host import HostTier

    base = Path(sys.argv[1])
    tier = HostTier(6 << 20, directory=base, pin_memory=False)  # fits in the 8 MiB at start
    with open(base / "someone-else", "wb") as f:  # then another user of /dev/shm takes 4 MiB
        f.write(b"\\1" * (4 << 20))
    try:
        for _ in range(6):
            ref = tier.reserve(1 << 20)
            tier.slot_array(ref)[:] = 7
    except TierUnavailable as exc:
        print("REFUSED", exc)
    except CapacityError as exc:
        print("FULL", exc)
    else:
        print("WROTE")
    """
)


def test_running_out_of_shared_memory_is_an_error_never_a_sigbus(small_shm: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FILL_SCRIPT, str(small_shm)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, f"the process died (signal {-done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("REFUSED") and "DSS_STORE__HOST_CAPACITY_BYTES" in done.stdout


# ----------------------------------------------------------------------------------- 3. generations
def test_a_slots_generation_moves_on_when_it_is_released_and_reused(tier: HostTier) -> None:
    first = tier.reserve(SLOT)
    arena = tier.arena(SLOT)
    other = HostArena.attach(first.path, SLOT)  # another process's mapping sees the same numbers
    try:
        assert arena.generation(first.slot) == other.generation(first.slot) == first.generation
        tier.release(first)
        again = tier.reserve(SLOT)
        assert again.slot == first.slot  # LIFO: the very slot
        assert again.generation != first.generation == again.generation - 1
        assert other.unchanged((first.slot,), (first.generation,)) == 0
        assert other.unchanged((again.slot,), (again.generation,)) == 1
        with pytest.raises(errors.InvalidInput):
            tier.release(first)  # a stale ref never frees the slot's new holder
        scrubbed = tier.scrub(again)
        assert scrubbed.generation == again.generation + 1 and not tier.current(again)
        tier.release(scrubbed)
        tier.check()
    finally:
        other.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(tmp_path / "data", shm_dir=tmp_path / "shm", write_through=False)
    s.fingerprints.register(SMALL_FP)
    try:
        yield s
    finally:
        s.close()


def _slot_bytes(ref: SlotRef) -> bytes:
    """The slot's bytes as a reader in another process sees them (its own mapping)."""
    arena = HostArena.attach(ref.path, ref.slot_nbytes, ref.n_slots)
    try:
        return arena.numpy(ref.slot).tobytes()
    finally:
        arena.close()


def test_a_leased_slot_is_not_reused_when_its_page_is_dropped(store: Store) -> None:
    fid = SMALL_FP.id
    alice_tokens = np.arange(1, 5, dtype=np.int32)
    bob_tokens = np.arange(900, 904, dtype=np.int32)
    (alice_page,) = pages_for(SMALL_FP, alice_tokens)
    (bob_page,) = pages_for(SMALL_FP, bob_tokens, salt=7)
    put_sequence(store, fid, store.identity.tenant_for("alice"), alice_tokens, [alice_page])
    plan = store.kv.begin_load(fid, store.identity.tenant_for("alice"), alice_tokens)
    assert plan is not None and not plan.is_async
    ref = plan.pages[0].slot
    assert ref is not None and _slot_bytes(ref) == alice_page
    # While the engine holds the load, alice's page is dropped and bob's page is saved.
    gone = store.pages.copies.drop([plan.pages[0].hash])
    store.kv.lookup.forget(gone)
    assert _slot_bytes(ref) == bytes(len(alice_page))  # zeroed at once, lease or not
    put_sequence(store, fid, store.identity.tenant_for("bob"), bob_tokens, [bob_page])
    copied = _slot_bytes(ref)  # the engine's copy through the ref it was given
    assert copied != bob_page, "a load was handed another tenant's page"
    arena = HostArena.attach(ref.path, ref.slot_nbytes, ref.n_slots)
    try:
        assert arena.unchanged((ref.slot,), (ref.generation,)) == 0  # and the copy is known stale
    finally:
        arena.close()
    store.check()
    assert store.kv.loads.release_checked(plan.load_id) == 0  # what the engine's check answers
    store.check()  # the slot was freed when the lease ended
    assert store.host.used_bytes == SMALL_FP.page_nbytes


def test_a_slot_parked_for_a_lease_is_freed_when_the_lease_ends(store: Store) -> None:
    fid = SMALL_FP.id
    tokens = np.arange(1, 9, dtype=np.int32)
    put_sequence(store, fid, store.identity.tenant_for("alice"), tokens, pages_for(SMALL_FP, tokens))
    plan = store.kv.begin_load(fid, store.identity.tenant_for("alice"), tokens)
    assert plan is not None
    store.eraser.erase_user("alice")
    assert store.host.used_bytes == 2 * SMALL_FP.page_nbytes  # held for the load, already zeroed
    for ps in plan.pages:
        assert ps.slot is not None and not any(_slot_bytes(ps.slot))
    store.check()
    store.kv.loads.release(plan.load_id)
    assert store.host.used_bytes == 0
    store.check()


def _worker_of(store: Store) -> tuple[Any, dict[str, torch.Tensor]]:
    """An engine worker of `SMALL_FP` with 8 blocks per layer, talking to `store` over its RPC."""
    from dss.rpc import StoreClient
    from engine_patch.connector.worker_side import WorkerSide

    address, authkey = store.serve_rpc()
    n_blocks = 8
    worker = WorkerSide(SMALL_FP, lambda: StoreClient(address, authkey), n_blocks)
    shape = (n_blocks, SMALL_FP.num_kv_heads, SMALL_FP.block_size, 2 * SMALL_FP.head_size)
    layers = {f"layer.{i}": torch.zeros(shape, dtype=torch.bfloat16) for i in range(SMALL_FP.num_layers)}
    worker.register_kv_caches(layers, lambda name: int(name.rsplit(".", 1)[1]))
    return worker, layers


def _block_bytes(layers: dict[str, torch.Tensor], block: int) -> bytes:
    """A block as a page lays it out: the block of layer 0, then layer 1."""
    parts = [kv[block].reshape(-1).view(torch.uint8) for kv in layers.values()]
    return torch.cat(parts).numpy().tobytes()


def test_the_engine_worker_discards_a_copy_whose_slot_moved_on(store: Store) -> None:
    pytest.importorskip("vllm")
    from dss.wire import span_of
    from engine_patch.connector.metadata import DSSConnectorMetadata, LoadSpec

    worker, layers = _worker_of(store)
    assert worker.ready
    fid = SMALL_FP.id
    alice_tokens = np.arange(1, 5, dtype=np.int32)
    bob_tokens = np.arange(900, 904, dtype=np.int32)
    (bob_page,) = pages_for(SMALL_FP, bob_tokens, salt=7)

    try:
        put_sequence(
            store, fid, store.identity.tenant_for("alice"), alice_tokens, pages_for(SMALL_FP, alice_tokens)
        )
        plan = store.kv.begin_load(fid, store.identity.tenant_for("alice"), alice_tokens)
        assert plan is not None
        span = span_of(plan.pages)
        assert span is not None
        # Between the scheduler's plan and the worker's copy, alice's page is dropped and bob's saved.
        store.kv.lookup.forget(store.pages.copies.drop([plan.pages[0].hash]))
        put_sequence(store, fid, store.identity.tenant_for("bob"), bob_tokens, [bob_page])
        worker.start_load_kv(
            DSSConnectorMetadata([LoadSpec("req-a", plan.load_id, ((5,),), span, False)], [])
        )
        assert _block_bytes(layers, 5) != bob_page, "another tenant's KV reached the engine's blocks"
        assert worker.get_block_ids_with_load_errors() == {5}  # recomputed, not served
        assert worker._copy_in(span, ((6,),)) == 0  # the worker's own check, without the store's
        # A slot that did not move on is copied and kept.
        bob_plan = store.kv.begin_load(fid, store.identity.tenant_for("bob"), bob_tokens)
        assert bob_plan is not None
        bob_span = span_of(bob_plan.pages)
        assert bob_span is not None and worker._copy_in(bob_span, ((3,),)) == 1
        assert _block_bytes(layers, 3) == bob_page
        store.kv.loads.release(bob_plan.load_id)
        store.check()
    finally:
        worker.shutdown()


def test_an_erasure_moves_its_pages_slots_on_before_its_commit(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine checks its copies by the slots' generations alone, with no store round trip on
    a hot turn (issue 31): from the moment an erasure takes a tenant's pages out of the page
    table, before its commit, a copy of their slots must be refused, and their bytes gone."""
    import dss.ops.erasure.eraser as eraser_module

    fid, tenant = SMALL_FP.id, store.identity.tenant_for("alice")
    tokens = np.arange(1, 9, dtype=np.int32)
    put_sequence(store, fid, tenant, tokens, pages_for(SMALL_FP, tokens))
    plan = store.kv.begin_load(fid, tenant, tokens)  # an engine about to copy
    assert plan is not None
    refs = [ps.slot for ps in plan.pages]
    assert all(r is not None for r in refs)
    first = refs[0]
    assert first is not None
    arena = HostArena.attach(first.path, first.slot_nbytes, first.n_slots)
    seen: list[tuple[int, bool]] = []
    real = eraser_module.append_receipt

    def before_the_commit(*args: Any, **kwargs: Any) -> Any:
        slots = [r.slot for r in refs if r is not None]
        generations = [r.generation for r in refs if r is not None]
        zeroed = all(not _slot_bytes(r).strip(b"\0") for r in refs if r is not None)
        seen.append((arena.unchanged(slots, generations), zeroed))
        return real(*args, **kwargs)

    monkeypatch.setattr(eraser_module, "append_receipt", before_the_commit)
    try:
        store.eraser.erase_user("alice")
        assert seen == [(0, True)], "a copy taken between the detach and the commit would pass"
    finally:
        arena.close()
    store.kv.loads.release(plan.load_id)
    store.check()
    assert store.host.used_bytes == 0


def test_a_failed_erasure_frees_its_host_slots_and_keeps_its_files(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host slots go when an erasure detaches its pages, so one whose transaction fails
    (`abandon`) has freed them already; its files stay for recovery and its pages may be saved
    again."""
    import dss.ops.erasure.eraser as eraser_module

    fid, tenant = SMALL_FP.id, store.identity.tenant_for("alice")
    tokens = np.arange(1, 9, dtype=np.int32)
    pages = pages_for(SMALL_FP, tokens)
    put_sequence(store, fid, tenant, tokens, pages)

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the database went away")

    monkeypatch.setattr(eraser_module, "append_receipt", failing)
    with pytest.raises(RuntimeError):
        store.eraser.erase_user("alice")
    assert store.host.used_bytes == 0
    store.check()
    monkeypatch.undo()
    put_sequence(store, fid, tenant, tokens, pages)  # stored again, in fresh slots
    assert store.host.used_bytes == len(pages) * SMALL_FP.page_nbytes
    store.check()


def test_a_load_that_leaves_out_the_leases_first_pages_checks_the_pages_it_copies(store: Store) -> None:
    """A load planned before the engine's own cache hit was known copies the pages after it
    (`LoadSpec.skip_pages`) and checks those by their slots' generations: a copied page dropped
    meanwhile fails the load from it, and the pages before it are kept. (A page left out cannot
    go alone: the pages after it in the index go with it.) Each load's lease is ended off the
    forward pass's thread, soon after."""
    pytest.importorskip("vllm")
    from dss.wire import span_of
    from engine_patch.connector.metadata import DSSConnectorMetadata, LoadSpec
    from tests.engine_helpers import wait_until

    worker, layers = _worker_of(store)
    fid, tenant = SMALL_FP.id, store.identity.tenant_for("alice")
    tokens = np.arange(1, 13, dtype=np.int32)  # 3 pages
    pages = pages_for(SMALL_FP, tokens)

    def load_after_first(blocks: tuple[int, int]) -> tuple[list[PageHash], LoadSpec]:
        plan = store.kv.begin_load(fid, tenant, tokens)
        assert plan is not None and len(plan.pages) == 3
        span = span_of(plan.pages[1:])
        assert span is not None
        hashes = [p.hash for p in plan.pages]
        return hashes, LoadSpec("req", plan.load_id, (blocks,), span, False, skip_pages=1)

    try:
        put_sequence(store, fid, tenant, tokens, pages)
        _hashes, spec = load_after_first((5, 6))
        worker.start_load_kv(DSSConnectorMetadata([spec], []))
        assert worker.get_block_ids_with_load_errors() == set()
        assert [_block_bytes(layers, 5), _block_bytes(layers, 6)] == pages[1:]
        assert wait_until(lambda: store.stats()["leases"] == 0, timeout_s=5.0)
        hashes, spec = load_after_first((3, 4))
        store.kv.lookup.forget(store.pages.copies.drop([hashes[2]]))  # the second page copied
        worker.start_load_kv(DSSConnectorMetadata([spec], []))
        assert worker.get_block_ids_with_load_errors() == {4}
        assert _block_bytes(layers, 3) == pages[1]
        assert wait_until(lambda: store.stats()["leases"] == 0, timeout_s=5.0)
        store.check()
    finally:
        worker.shutdown()


def test_a_worker_unmaps_the_arena_of_a_store_that_restarted(tmp_path: Path) -> None:
    """A restarted store makes its arena in a new directory; the worker's mapping of the old one
    (unlinked, but reserved in full) must not keep that memory allocated for the engine's life."""
    from tests.engine_helpers import wait_until

    views = ArenaViews(1, SLOT)
    first = HostTier(4 * SLOT, directory=tmp_path / "shm", pin_memory=False)
    old_path = first.reserve(SLOT).path
    views.pages(old_path, SLOT)
    first.close()  # the store stops (or dies); its successor makes a new arena
    second = HostTier(4 * SLOT, directory=tmp_path / "shm", pin_memory=False)
    try:
        new_path = second.reserve(SLOT).path
        assert new_path != old_path
        views.pages(new_path, SLOT)

        def mapped(path: str) -> bool:
            return path in Path("/proc/self/maps").read_text()

        # Unmapped once nothing uses the old mapping any more: its prefault thread (at the lowest
        # priority, so late on a busy machine) may still hold it for a moment.
        assert wait_until(lambda: not mapped(old_path), timeout_s=10.0) and mapped(new_path)
    finally:
        views.close()
        second.close()
