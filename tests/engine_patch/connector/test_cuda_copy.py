"""The CUDA copy path (`engine_patch.connector.cuda_copy`) on a real device: pages through a pinned
host arena, ordered with the engine's compute stream, in vLLM 0.32's layouts.

The `gpu` tests are skipped without CUDA; `make test-gpu` runs them on a machine that has torch and
a GPU and nothing else of DSS's environment: no vLLM import (the engine's views are built by
`kv_copies`, which `test_kv_layouts.py` holds to vLLM's allocator) and no conftest fixtures. The
device-side half of the CUDA copies (staging buffer <-> blocks) also runs here on CPU tensors.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from dss.pages.tiers.host import HostArena
from engine_patch.connector.copy import ArenaViews, KVBlocks, runs
from engine_patch.connector.layouts import VLLM_AXES, KVLayout
from tests.engine_patch.connector.kv_copies import (
    BLOCKS,
    DTYPE,
    NB,
    SLOTS,
    TARGETS,
    L,
    arena_pages,
    assert_same_kv,
    engine_layers,
    round_trip,
    vllm_block_kv,
)

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_device_side_copies_on_cpu_tensors() -> None:
    """What the CUDA path runs on the device between its DMAs (`gather_to_staging`,
    `scatter_from_staging`), here on CPU tensors: each run gathered into a staging buffer shaped
    like its slots is exactly the bytes the CPU path saves, and scattering those buffers into
    another layout gives the same K and V."""
    src = engine_layers("LBNHC", seed=11)
    dst = engine_layers("LBHNC", seed=None)
    layout = KVLayout(VLLM_AXES, NB)
    saver, loader = KVBlocks(src, layout), KVBlocks(dst, layout)
    saving = runs(BLOCKS, SLOTS)
    expected = arena_pages(saver.layer_block_nbytes)
    saver.save(expected, saving)

    pages = arena_pages(saver.layer_block_nbytes)
    gather = saver.gather_to_staging(saving)
    for i, r in enumerate(saving):
        staging = torch.empty_like(pages[r.slot : r.slot + r.n])
        gather(i, staging)
        pages[r.slot : r.slot + r.n] = staging
    assert torch.equal(pages, expected)

    loading = runs(TARGETS, SLOTS)
    scatter = loader.scatter_from_staging(loading)
    for i, r in enumerate(loading):
        scatter(i, pages[r.slot : r.slot + r.n].clone())
    assert_same_kv(src, vllm_block_kv(), dst, vllm_block_kv())


@pytest.mark.gpu
@NEEDS_CUDA
def test_cuda_pages_through_a_pinned_arena_match_the_cpu_copy() -> None:
    """The arena is registered as pinned memory; a save from FlashAttention's layout (LBNHC) writes
    exactly the bytes the CPU path writes for the same values; a load into FlashInfer's HND layout
    gives the same K and V; the copies are ordered with the compute stream (values written by a
    kernel right before the save are saved; a kernel right after the load reads the loaded values)."""
    src = engine_layers("LBNHC", device="cuda", seed=None)
    dst = engine_layers("LBHNC", device="cuda", seed=None)
    layout = KVLayout(VLLM_AXES, NB)
    saver, loader = KVBlocks(src, layout), KVBlocks(dst, layout)
    assert saver.on_cuda and loader.on_cuda
    g = torch.Generator(device="cuda").manual_seed(8)
    for t in src:  # queued on the compute stream, not waited for: the save must order itself
        t.copy_(torch.randn(t.shape, generator=g, device="cuda").to(DTYPE))

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm) as private:  # mode 0700, as the store's own
        path = Path(private) / "arena.shm"
        arena = HostArena.create(path, L * saver.layer_block_nbytes, 8)
        views = ArenaViews(L, saver.layer_block_nbytes, pin=True)
        try:
            pages = views.pages(str(path), arena.slot_nbytes)
            assert pages.is_pinned()  # cudaHostRegister over the shared mapping
            saver.save(pages, runs(BLOCKS, SLOTS))  # returns once the pages are in the arena

            cpu_src = [t.cpu() for t in src]
            expected = arena_pages(saver.layer_block_nbytes)
            KVBlocks(cpu_src, layout).save(expected, runs(BLOCKS, SLOTS))
            for s in SLOTS:
                assert torch.equal(pages[s], expected[s])

            loader.load(pages, runs(TARGETS, SLOTS))
            sums = torch.stack([t.float().sum() for t in dst])  # on the compute stream, right after
            got = [t.cpu() for t in dst]
            assert_same_kv(cpu_src, vllm_block_kv(), got, vllm_block_kv())
            want = torch.stack([t.float().sum() for t in got])
            assert torch.allclose(sums.cpu(), want)
        finally:
            views.close()
            arena.close()


@pytest.mark.gpu
@NEEDS_CUDA
def test_cuda_kernel_blocks_and_mla_round_trip() -> None:
    split = engine_layers("LBNHC", block_size=32, kernel_block_size=16, device="cuda", seed=9)
    whole = engine_layers("LBHNC", block_size=32, device="cuda", seed=None)
    layout = KVLayout(VLLM_AXES, NB)
    round_trip(split, layout, whole, layout)  # an unpinned tensor: correct, only slower
    assert_same_kv(
        [t.cpu() for t in split], vllm_block_kv(kernel_blocks=2), [t.cpu() for t in whole], vllm_block_kv()
    )
    src = engine_layers("LBNHC", heads=1, content=24, device="cuda", seed=10)
    dst = engine_layers("LBHNC", heads=1, content=24, device="cuda", seed=None)
    round_trip(src, layout, dst, layout)
    mla = vllm_block_kv(mla=True)
    assert_same_kv([t.cpu() for t in src], mla, [t.cpu() for t in dst], mla)
