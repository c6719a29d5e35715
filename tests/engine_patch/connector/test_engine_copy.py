"""Page copies between KV blocks shaped like vLLM's CPU cache and a real shared-memory arena."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from dss.errors import InvalidInput
from dss.namespace import ModelFingerprint
from dss.pages.tiers.host import HostArena
from engine_patch.connector.copy import ArenaViews, KVBlocks, Run, runs
from engine_patch.connector.fingerprint import UnsupportedKVCache, check_layer_tensors, model_revision
from engine_patch.connector.layouts import VLLM_AXES, KVLayout
from engine_patch.connector.worker_side import order_layers

L, NB, H, BS, HD = 4, 16, 3, 32, 16
FP = ModelFingerprint("tiny", "r", "bfloat16", num_layers=L, num_kv_heads=H, head_size=HD, block_size=BS)
CPU = KVLayout(VLLM_AXES, NB, packed=True)  # the CPU backend's blocks: bytes as they are


def make_layers(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NB, H, BS, 2 * HD, generator=g).to(torch.bfloat16) for _ in range(L)]


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[HostArena]:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    a = HostArena.create(shm / f"dss-test-copy-{os.getpid()}-{time.monotonic_ns()}.shm", FP.page_nbytes, 12)
    yield a
    a.close()
    a.unlink()


def test_runs_split_where_blocks_or_slots_jump() -> None:
    assert runs([], []) == []
    assert runs([5, 6, 7, 9, 10, 3], [0, 1, 2, 3, 4, 8]) == [Run(5, 0, 3), Run(9, 3, 2), Run(3, 8, 1)]
    assert runs([1, 2, 3], [4, 6, 7]) == [Run(1, 4, 1), Run(2, 6, 2)]
    with pytest.raises(InvalidInput):
        runs([1, 2], [1])


@pytest.mark.parametrize("n", [1, 2, 33, 256, 257, 4096])
def test_runs_of_a_short_and_a_long_load_split_alike(n: int) -> None:
    """A short list is split by a plain loop, a long one by numpy: the same runs either way."""
    rng = np.random.default_rng(n)
    for _ in range(20):
        blocks = np.cumsum(rng.integers(1, 3, n)).tolist()
        slots = np.cumsum(rng.integers(1, 3, n)).tolist()
        got = runs(blocks, slots)
        assert sum(r.n for r in got) == n
        want, first = [], 0  # by definition: cut wherever blocks or slots do not step by one
        for i in range(1, n + 1):
            if i == n or blocks[i] != blocks[i - 1] + 1 or slots[i] != slots[i - 1] + 1:
                want.append(Run(blocks[first], slots[first], i - first))
                first = i
        assert got == want


def test_save_writes_layer_major_pages_and_load_restores_them(arena: HostArena) -> None:
    src = make_layers(1)
    views = ArenaViews(L, FP.layer_block_nbytes)
    pages = views.pages(str(arena.path), arena.slot_nbytes)
    assert pages.shape == (12, L, FP.layer_block_nbytes)
    blocks, slots = [3, 4, 5, 11, 0], [7, 8, 9, 1, 2]
    KVBlocks(src, CPU).save(pages, runs(blocks, slots))
    # Page bytes = block b of layer 0, then layer 1, ...: exactly the engine's block bytes.
    for b, s in zip(blocks, slots, strict=True):
        page = arena.numpy(s)
        for layer in range(L):
            want = src[layer][b].contiguous().view(torch.uint8).numpy().reshape(-1)
            got = page[layer * FP.layer_block_nbytes : (layer + 1) * FP.layer_block_nbytes]
            assert np.array_equal(got, want)
    # Loading into other blocks of a fresh cache restores exactly those blocks, nothing else.
    dst = [torch.zeros_like(t) for t in src]
    targets = [8, 9, 10, 2, 15]
    KVBlocks(dst, CPU).load(pages, runs(targets, slots))
    for layer in range(L):
        for b, t in zip(blocks, targets, strict=True):
            assert torch.equal(dst[layer][t], src[layer][b])
        untouched = [i for i in range(NB) if i not in targets]
        assert not dst[layer][untouched].any()
    views.close()


def test_copies_reject_out_of_range_blocks_and_slots(arena: HostArena) -> None:
    views = ArenaViews(L, FP.layer_block_nbytes)
    pages = views.pages(str(arena.path), arena.slot_nbytes)
    kv = KVBlocks(make_layers(2), CPU)
    with pytest.raises(InvalidInput):
        kv.load(pages, [Run(NB - 1, 0, 2)])
    with pytest.raises(InvalidInput):
        kv.save(pages, [Run(0, 11, 2)])
    with pytest.raises(InvalidInput):
        views.pages(str(arena.path), arena.slot_nbytes + 2)
    views.close()


def test_arena_views_reattach_when_the_file_is_recreated(tmp_path: Path) -> None:
    path = Path("/dev/shm") / f"dss-test-reattach-{os.getpid()}-{time.monotonic_ns()}.shm"
    first = HostArena.create(path, FP.page_nbytes, 2)
    views = ArenaViews(L, FP.layer_block_nbytes)
    try:
        first.numpy(0)[:] = 1
        assert int(views.pages(str(path), FP.page_nbytes)[0, 0, 0]) == 1
        first.close()
        first.unlink()
        # A restarted store recreates the arena at the same path: the old mapping must not be used.
        second = HostArena.create(path, FP.page_nbytes, 3)
        second.numpy(0)[:] = 7
        pages = views.pages(str(path), FP.page_nbytes)
        assert pages.shape[0] == 3 and int(pages[0, 0, 0]) == 7
        second.close()
    finally:
        views.close()
        path.unlink(missing_ok=True)


def test_an_attached_arena_is_mapped_in_the_background(arena: HostArena) -> None:
    """The worker maps an arena's slots off the engine's steps (`HostArena.prefault`), so a
    save's first copy into a slot takes no page fault per 4 KiB (before: 120-180 ms of a step for
    a 2,000-token prompt's 47 MB). Its thread ends when every slot is mapped."""
    import resource
    import threading

    views = ArenaViews(L, FP.layer_block_nbytes)
    pages = views.pages(str(arena.path), arena.slot_nbytes)
    deadline = time.monotonic() + 30
    while any(t.name == "dss-arena-prefault" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the prefault thread did not finish"
        time.sleep(0.01)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    KVBlocks(make_layers(2), CPU).save(pages, runs(list(range(12)), list(range(12))))
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    assert faults < 12 * FP.page_nbytes // 4096 // 4, faults  # not one per 4 KiB written
    views.close()


def test_check_layer_tensors_accepts_only_the_fingerprinted_shape() -> None:
    layers = dict(enumerate(make_layers(3)))
    check_layer_tensors(FP, layers, NB)
    with pytest.raises(UnsupportedKVCache):
        check_layer_tensors(FP, {i: t for i, t in layers.items() if i < L - 1}, NB)
    with pytest.raises(UnsupportedKVCache):
        check_layer_tensors(FP, {i: t.float() for i, t in layers.items()}, NB)
    with pytest.raises(UnsupportedKVCache):
        check_layer_tensors(FP, {i: t[:, :2] for i, t in layers.items()}, NB)
    with pytest.raises(UnsupportedKVCache):
        check_layer_tensors(FP, layers, NB + 1)


def test_layers_are_ordered_by_layer_index() -> None:
    names = {f"model.layers.{i}.self_attn.attn": torch.full((1,), float(i)) for i in (10, 2, 0, 1)}
    ordered = order_layers(names, lambda n: int(n.split(".")[2]))
    assert [(i, int(t.item())) for i, t in ordered.items()] == [(0, 0), (1, 1), (2, 2), (10, 10)]
    with pytest.raises(UnsupportedKVCache):
        order_layers({"a.1": torch.zeros(1), "b.1": torch.zeros(1)}, lambda n: int(n.split(".")[1]))


def test_model_revision_follows_content(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"a": 1, "b": 2}')
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * 8192)
    r1 = model_revision(str(tmp_path))
    assert model_revision(str(tmp_path)) == r1
    (tmp_path / "config.json").write_text('{"b": 2, "a": 1}')  # same config, other key order
    assert model_revision(str(tmp_path)) == r1
    data = bytearray(weights.read_bytes())
    data[0] ^= 1  # a fine-tune: same size, other bytes
    weights.write_bytes(bytes(data))
    assert model_revision(str(tmp_path)) != r1
    assert model_revision("org/some-hub-model", "abc").startswith("hub:")


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [
        (torch.bfloat16, "auto"),
        (torch.float32, "auto"),
        (torch.bfloat16, "fp8_e4m3"),
        (torch.float32, "fp8_e5m2"),
    ],
)
def test_a_tail_page_keeps_only_its_valid_positions(
    tmp_path: Path, dtype: torch.dtype, kv_cache_dtype: str
) -> None:
    """An engine block is reused uncleared: a tail page copied from it would carry the previous
    user's KV in the positions the new sequence has not reached. After `scrub_after`, the page
    is exactly what the block would hold had it been zero when the valid tokens were written
    (an fp8 cache: the model's `dtype` values quantized into bytes, scales 0.5 and 2)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if kv_cache_dtype != "auto" and not (
        torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
    ):
        pytest.skip("vLLM's CPU build runs fp8 KV caches only with AVX-512 or AMX")
    bs, hd, valid = 128, 64, 37  # the CPU kernel's shapes (block 128, head 64)
    isa = _get_attn_isa(dtype, bs, hd, kv_cache_dtype)
    cache_dtype = dtype if kv_cache_dtype == "auto" else torch.uint8

    def write(kv: torch.Tensor, positions: range, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        n = len(positions)
        key = torch.randn(n, H, hd, generator=gen).to(dtype)
        value = torch.randn(n, H, hd, generator=gen).to(dtype)
        key_cache, value_cache = kv.view(kv.shape[0], H, 2 * bs, hd).chunk(2, dim=2)
        slots = torch.arange(positions.start, positions.stop, dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slots, isa, 0.5, 2.0, kv_cache_dtype
        )

    layers = [torch.zeros(2, H, bs, 2 * hd, dtype=cache_dtype) for _ in range(2)]
    expected = [torch.zeros_like(t) for t in layers]
    for i, (kv, want) in enumerate(zip(layers, expected, strict=True)):
        write(kv, range(0, bs), seed=100 + i)  # another request filled block 0 before
        write(kv, range(0, valid), seed=i)  # this sequence's tokens
        write(want, range(0, valid), seed=i)
    page_nbytes = 2 * layers[0][0].numel() * layers[0].element_size()
    arena = HostArena.create(
        Path("/dev/shm") / f"dss-test-tail-{os.getpid()}-{time.monotonic_ns()}.shm", page_nbytes, 2
    )
    try:
        views = ArenaViews(2, page_nbytes // 2)
        pages = views.pages(str(arena.path), arena.slot_nbytes)
        blocks = KVBlocks(layers, KVLayout(VLLM_AXES, 2, packed=True))
        blocks.save(pages, [Run(0, 1, 1)])
        want = np.concatenate([w[0].contiguous().view(torch.uint8).numpy().reshape(-1) for w in expected])
        assert not np.array_equal(arena.numpy(1), want), "precondition: the copy holds stale positions"
        blocks.scrub_after(pages, 1, valid, isa, kv_cache_dtype)
        assert np.array_equal(arena.numpy(1), want)
        with pytest.raises(InvalidInput):
            blocks.scrub_after(pages, 1, bs, isa, kv_cache_dtype)
        views.close()
    finally:
        arena.close()
        arena.unlink()
