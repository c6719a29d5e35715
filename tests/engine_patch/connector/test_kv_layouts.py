"""KV layouts: a page saved from one attention layout loads into another layout of the same model
with the same K and V for every token and head (`engine_patch.connector.layouts`, `KVBlocks`).

vLLM 0.32's layer tensors are made by vLLM's own allocator (`allocate_kv_cache`, the function its
GPU model runner calls) for each `KVCacheLayout`, from real `FullAttentionSpec`/`MLAAttentionSpec`
objects, on CPU tensors. The K/V-split shapes older vLLM backends declared through
`get_kv_cache_shape` (no longer in 0.32's backends) are built here by hand, each with the file it
came from. The CUDA path is in the `gpu`-marked tests at the end (skipped without CUDA).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from dss.errors import InvalidInput
from dss.namespace import LATENT_ROWS_ISA, ModelFingerprint
from dss.pages.tiers.host import HostArena
from engine_patch.connector.copy import ArenaViews, KVBlocks, Run, runs
from engine_patch.connector.fingerprint import _layout_name, attention_isa, check_layer_tensors
from engine_patch.connector.layouts import CANONICAL_FORMAT, VLLM_AXES, KVLayout, layout_for, physical_order

L, NB, H, BS, D = 3, 12, 4, 16, 8  # layers, blocks, KV heads, block size, head size
DTYPE = torch.bfloat16
BLOCKS, SLOTS = [2, 3, 4, 9, 0, 7], [5, 6, 7, 1, 2, 3]  # runs: 3 consecutive, then three single
TARGETS = [10, 11, 5, 1, 6, 8]  # where the loading engine's blocks are (other runs again)
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

KV = tuple[torch.Tensor, torch.Tensor | None]  # K [H, N, D] and V (None for MLA's latent)
BlockKV = Callable[[torch.Tensor, int], KV]


# ------------------------------------------------------------------ engines of each layout
def attention_spec(block_size: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=H, head_size=D, dtype=DTYPE)


def vllm_layers(
    layout: KVCacheLayout,
    spec: AttentionSpec,
    *,
    kernel_block_size: int | None = None,
    device: str = "cpu",
    seed: int | None = 0,
) -> list[torch.Tensor]:
    """The layer tensors vLLM 0.32 gives a connector for `layout` (vllm/v1/worker/utils.py
    `allocate_kv_cache`, strides from vllm/v1/kv_cache_interface.py), random data unless `seed`
    is None (zeros)."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NB, L, layout)
    tensor = KVCacheTensor(
        size=L * NB * spec.page_size_bytes, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    config = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        kv_cache_layout=layout.name,
    )
    kernel = [kernel_block_size] if kernel_block_size is not None else None
    caches = allocate_kv_cache(config, torch.device(device), layout, kernel)
    layers = [caches[n] for n in names]
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for t in layers:
            t.copy_(torch.randn(t.shape, generator=g).to(DTYPE))
    return layers


def vllm_block_kv(kernel_blocks: int = 1, mla: bool = False) -> BlockKV:
    """K and V of manager block `b` in vLLM's `[B*S, H, N/S, C]` view: C is K then V."""

    def kv(t: torch.Tensor, b: int) -> KV:
        block = torch.cat([t[b * kernel_blocks + s] for s in range(kernel_blocks)], dim=1)  # [H, N, C]
        if mla:
            return block, None
        return block[..., :D], block[..., D:]

    return kv


def flash_attn_old(seed: int | None) -> torch.Tensor:
    """FlashAttention before vLLM 0.32 (v1/attention/backends/flash_attn.py get_kv_cache_shape):
    `(2, num_blocks, block_size, num_kv_heads, head_size)`, K at 0 and V at 1."""
    return _random((2, NB, BS, H, D), seed)


def flash_attn_old_kv(t: torch.Tensor, b: int) -> KV:
    return t[0, b].transpose(0, 1), t[1, b].transpose(0, 1)


def flashinfer_old(seed: int | None, hnd: bool) -> torch.Tensor:
    """FlashInfer before vLLM 0.32 (v1/attention/backends/flashinfer.py): logical
    `(num_blocks, 2, block_size, num_kv_heads, head_size)`; under the HND layout its
    `get_kv_cache_stride_order` was (0, 1, 3, 2, 4): heads outside tokens in memory."""
    if not hnd:
        return _random((NB, 2, BS, H, D), seed)
    return _random((NB, 2, H, BS, D), seed).permute(0, 1, 3, 2, 4)


def flashinfer_old_kv(t: torch.Tensor, b: int) -> KV:
    return t[b, 0].transpose(0, 1), t[b, 1].transpose(0, 1)


def _random(shape: tuple[int, ...], seed: int | None) -> torch.Tensor:
    if seed is None:
        return torch.zeros(shape, dtype=DTYPE)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DTYPE)


# ------------------------------------------------------------------ the round trip
def arena_pages(layer_block_nbytes: int, n_slots: int = 8) -> torch.Tensor:
    """An arena-like uint8 tensor, `[n_slots, num_layers, layer_block_nbytes]` (as `ArenaViews`)."""
    return torch.full((n_slots, L, layer_block_nbytes), 0xA5, dtype=torch.uint8)


def round_trip(
    src: list[torch.Tensor], src_layout: KVLayout, dst: list[torch.Tensor], dst_layout: KVLayout
) -> torch.Tensor:
    saver, loader = KVBlocks(src, src_layout), KVBlocks(dst, dst_layout)
    assert saver.layer_block_nbytes == loader.layer_block_nbytes
    assert saver.block_shape == loader.block_shape
    pages = arena_pages(saver.layer_block_nbytes)
    saver.save(pages, runs(BLOCKS, SLOTS))
    loader.load(pages, runs(TARGETS, SLOTS))
    return pages


def assert_same_kv(
    src: list[torch.Tensor], src_kv: BlockKV, dst: list[torch.Tensor], dst_kv: BlockKV
) -> None:
    """Every token and head of every copied block: the loading engine has the saver's K and V;
    every other block of the loading engine is untouched (zero)."""
    for layer in range(L):
        for b, t in zip(BLOCKS, TARGETS, strict=True):
            k_src, v_src = src_kv(src[layer], b)
            k_dst, v_dst = dst_kv(dst[layer], t)
            assert k_dst.shape == k_src.shape
            assert torch.equal(k_dst, k_src), f"layer {layer} block {b}->{t}: K differs"
            if v_src is None or v_dst is None:
                assert v_src is None and v_dst is None
            else:
                assert torch.equal(v_dst, v_src), f"layer {layer} block {b}->{t}: V differs"
        for other in set(range(NB)) - set(TARGETS):
            k, v = dst_kv(dst[layer], other)
            assert not k.any() and (v is None or not v.any())


LAYOUTS = list(KVCacheLayout)


@pytest.mark.parametrize("src_layout", LAYOUTS, ids=lambda m: m.name)
def test_every_vllm_layout_loads_into_every_other(src_layout: KVCacheLayout) -> None:
    src = vllm_layers(src_layout, attention_spec(), seed=1)
    layout = KVLayout(VLLM_AXES, NB)
    pages = None
    for dst_layout in LAYOUTS:
        dst = vllm_layers(dst_layout, attention_spec(), seed=None)
        got = round_trip(src, layout, dst, layout)
        assert_same_kv(src, vllm_block_kv(), dst, vllm_block_kv())
        if pages is not None:  # one canonical form: the same bytes whatever the loader's layout
            assert torch.equal(got, pages)
        pages = got


def test_flash_attention_nhd_and_flashinfer_hnd_store_the_same_page() -> None:
    """FlashAttention (LBNHC, tokens outside heads) and FlashInfer on Blackwell (LBHNC, heads
    outside tokens) save byte-identical pages for the same K and V, in the canonical [H, N, C]."""
    nhd = vllm_layers(KVCacheLayout.LBNHC, attention_spec(), seed=3)
    hnd = vllm_layers(KVCacheLayout.LBHNC, attention_spec(), seed=None)
    layout = KVLayout(VLLM_AXES, NB)
    for a, b in zip(nhd, hnd, strict=True):
        b.copy_(a)  # the same values in the other physical layout
    assert physical_order(nhd[0], layout) == "BNHC" and physical_order(hnd[0], layout) == "BHNC"
    pages = []
    for layers in (nhd, hnd):
        p = arena_pages(KVBlocks(layers, layout).layer_block_nbytes)
        KVBlocks(layers, layout).save(p, runs(BLOCKS, SLOTS))
        pages.append(p)
    assert torch.equal(pages[0], pages[1])
    # The canonical block: head-major, then tokens, then K and V of that head and token.
    slot, block = SLOTS[0], BLOCKS[0]
    canon = pages[0][slot, 1].view(DTYPE).view(H, BS, 2 * D)
    for h in range(H):
        for n in range(BS):
            assert torch.equal(canon[h, n], nhd[1][block, h, n])


def test_kernel_blocks_inside_a_manager_block_are_one_page() -> None:
    """A manager block of 32 tokens split into kernel blocks of 16 (`[2*B, H, 16, C]`) saves the
    same page as an unsplit engine with 32-token blocks."""
    split = vllm_layers(KVCacheLayout.LBNHC, attention_spec(32), kernel_block_size=16, seed=4)
    assert split[0].shape == (2 * NB, H, 16, 2 * D)
    whole = vllm_layers(KVCacheLayout.LBHNC, attention_spec(32), seed=None)
    layout = KVLayout(VLLM_AXES, NB)
    round_trip(split, layout, whole, layout)
    assert_same_kv(split, vllm_block_kv(kernel_blocks=2), whole, vllm_block_kv())
    blocks = KVBlocks(split, layout)
    assert blocks.block_shape == (H, 32, 2 * D)
    fp = ModelFingerprint("m", "r", "bfloat16", num_layers=L, num_kv_heads=H, head_size=D, block_size=32)
    check_layer_tensors(
        fp, dict(enumerate(blocks.views)), NB
    )  # what the worker checks against the fingerprint
    back = vllm_layers(KVCacheLayout.LBNHC, attention_spec(32), kernel_block_size=16, seed=None)
    round_trip(whole, layout, back, layout)
    assert_same_kv(whole, vllm_block_kv(), back, vllm_block_kv(kernel_blocks=2))


OLD_SHAPES: dict[str, tuple[str, Callable[[int | None], torch.Tensor], BlockKV]] = {
    "flash_attn": ("KBNHD", flash_attn_old, flash_attn_old_kv),
    "flashinfer_nhd": ("BKNHD", lambda s: flashinfer_old(s, hnd=False), flashinfer_old_kv),
    "flashinfer_hnd": ("BKNHD", lambda s: flashinfer_old(s, hnd=True), flashinfer_old_kv),
}


@pytest.mark.parametrize("src_name", list(OLD_SHAPES))
@pytest.mark.parametrize("dst_name", [*OLD_SHAPES, "vllm_LBNHC"])
def test_k_v_split_shapes_share_pages_with_vllm_views(src_name: str, dst_name: str) -> None:
    axes, make, src_kv = OLD_SHAPES[src_name]
    src = [make(10 + i) for i in range(L)]
    if dst_name == "vllm_LBNHC":
        dst, dst_axes, dst_kv = (
            vllm_layers(KVCacheLayout.LBNHC, attention_spec(), seed=None),
            VLLM_AXES,
            vllm_block_kv(),
        )
    else:
        dst_axes, dst_make, dst_kv = OLD_SHAPES[dst_name]
        dst = [dst_make(None) for _ in range(L)]
    pages = round_trip(src, KVLayout(axes, NB), dst, KVLayout(dst_axes, NB))
    assert_same_kv(src, src_kv, dst, dst_kv)
    # The page is the canonical form, whichever shape saved it.
    vllm = vllm_layers(KVCacheLayout.LBHNC, attention_spec(), seed=None)
    for layer in range(L):
        for b in range(NB):
            k, v = src_kv(src[layer], b)
            vllm[layer][b].copy_(torch.cat([k, v], dim=-1))
    expected = arena_pages(pages.shape[2])
    KVBlocks(vllm, KVLayout(VLLM_AXES, NB)).save(expected, runs(BLOCKS, SLOTS))
    assert torch.equal(pages, expected)


def test_mla_latent_cache_round_trips_between_its_shapes() -> None:
    """MLA's latent cache: vLLM 0.32's `[B, 1, N, D_latent]` view (MLAAttentionSpec, one head,
    no V) and the `(num_blocks, block_size, D_latent)` its backends declared before (e.g.
    v1/attention/backends/mla/flashinfer_mla_sparse_sm90.py still does): the same latent per token."""
    latent = 24
    spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=latent, dtype=DTYPE)
    src = vllm_layers(KVCacheLayout.LBNHC, spec, seed=5)
    assert src[0].shape == (NB, 1, BS, latent)
    old = [torch.zeros(NB, BS, latent, dtype=DTYPE) for _ in range(L)]
    round_trip(src, KVLayout(VLLM_AXES, NB), old, KVLayout("BNC", NB))
    assert_same_kv(src, vllm_block_kv(mla=True), old, lambda t, b: (t[b].unsqueeze(0), None))
    assert KVBlocks(old, KVLayout("BNC", NB)).block_shape == (1, BS, latent)
    back = vllm_layers(KVCacheLayout.LBHNC, spec, seed=None)
    round_trip(old, KVLayout("BNC", NB), back, KVLayout(VLLM_AXES, NB))
    assert_same_kv(old, lambda t, b: (t[b].unsqueeze(0), None), back, vllm_block_kv(mla=True))


def test_the_cpu_layout_copies_blocks_as_they_are() -> None:
    """The CPU backend's blocks are ISA-packed: a page holds each block's bytes unchanged, and
    loading it back restores them bit for bit."""
    src = vllm_layers(KVCacheLayout.LBHNC, attention_spec(), seed=6)
    cpu = KVLayout(VLLM_AXES, NB, packed=True)
    dst = vllm_layers(KVCacheLayout.LBHNC, attention_spec(), seed=None)
    pages = round_trip(src, cpu, dst, cpu)
    for layer in range(L):
        for b, s, t in zip(BLOCKS, SLOTS, TARGETS, strict=True):
            assert torch.equal(pages[s, layer], src[layer][b].contiguous().view(torch.uint8).reshape(-1))
            assert torch.equal(dst[layer][t], src[layer][b])
    with pytest.raises(InvalidInput):
        KVLayout("KBNHD", NB, packed=True)  # packed bytes are never rearranged
    with pytest.raises(InvalidInput):  # nor regrouped from kernel blocks
        KVBlocks(vllm_layers(KVCacheLayout.LBNHC, attention_spec(32), kernel_block_size=16), cpu)


def test_layout_for_follows_the_fingerprint() -> None:
    cpu = ModelFingerprint("m", "r", "bfloat16", 2, 2, 64, 16, kv_layout="LBHNC", isa="cpu-amx")
    gpu = ModelFingerprint("m", "r", "bfloat16", 2, 2, 64, 16, kv_layout=CANONICAL_FORMAT, isa="none")
    assert layout_for(cpu, 5) == KVLayout(VLLM_AXES, 5, packed=True)
    assert layout_for(gpu, 5) == KVLayout(VLLM_AXES, 5, packed=False)
    assert cpu.id != gpu.id


def _config(use_mla: bool) -> Any:
    def unresolved() -> str:
        raise ValueError("not resolved yet")

    return SimpleNamespace(
        model_config=SimpleNamespace(use_mla=use_mla),
        cache_config=SimpleNamespace(cache_dtype="auto", get_resolved_kv_cache_layout=unresolved),
    )


def test_fingerprint_names_packed_cpu_blocks_and_canonical_pages_apart() -> None:
    """On this CPU build: CPU_ATTN's packed blocks keep their layout and ISA (the ids of pages
    stored before stay valid); MLA's plain latent cache on CPU is named by its own isa (the CPU
    MLA backend's rows, `dss.namespace.LATENT_ROWS_ISA`; its layout is `LATENT_KV_LAYOUT`)."""
    assert _layout_name(_config(use_mla=False), None) == "LBHNC"
    assert _layout_name(_config(use_mla=False), SimpleNamespace(kv_cache_layout="LBHNC")) == "LBHNC"
    assert attention_isa(_config(use_mla=False), DTYPE, 128, 64).startswith("cpu-")
    assert _layout_name(_config(use_mla=True), None) == CANONICAL_FORMAT
    assert attention_isa(_config(use_mla=True), DTYPE, 16, 576) == LATENT_ROWS_ISA


def test_a_canonical_tail_page_keeps_only_its_valid_positions() -> None:
    src = vllm_layers(KVCacheLayout.LBNHC, attention_spec(), seed=7)
    blocks = KVBlocks(src, KVLayout(VLLM_AXES, NB))
    pages = arena_pages(blocks.layer_block_nbytes)
    blocks.save(pages, [Run(4, 2, 1)])
    valid = 5
    blocks.scrub_after(pages, 2, valid, isa="")
    for layer in range(L):
        canon = pages[2, layer].view(DTYPE).view(H, BS, 2 * D)
        assert torch.equal(canon[:, :valid], src[layer][4, :, :valid])
        assert not canon[:, valid:].any()
    with pytest.raises(InvalidInput):
        blocks.scrub_after(pages, 2, BS, isa="")


def test_layouts_refuse_what_they_cannot_describe() -> None:
    for axes in ("BHN", "BHNCK", "BHNKC", "HNC", "BBNC", "BHNX"):
        with pytest.raises(InvalidInput):
            KVLayout(axes, NB)
    with pytest.raises(InvalidInput):
        KVLayout(VLLM_AXES, 0)
    layers = vllm_layers(KVCacheLayout.LBNHC, attention_spec(), seed=None)
    with pytest.raises(InvalidInput):
        KVBlocks(layers, KVLayout(VLLM_AXES, NB + 1))  # 12 blocks are not kernel blocks of 13
    with pytest.raises(InvalidInput):
        KVBlocks(layers, KVLayout("KBNHD", NB))  # a 4-dim tensor under 5 axes
    with pytest.raises(InvalidInput):
        KVBlocks([layers[0], layers[1].float()], KVLayout(VLLM_AXES, NB))


# ------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@NEEDS_CUDA
def test_cuda_pages_through_a_pinned_arena_match_the_cpu_copy() -> None:
    """On a real CUDA device: the arena is registered as pinned memory; a save from FlashAttention's
    layout (LBNHC) writes exactly the bytes the CPU path writes for the same values; a load into
    FlashInfer's HND layout gives the same K and V; the copies are ordered with the compute stream
    (values written by a kernel right before the save are saved; a kernel right after the load
    reads the loaded values)."""
    src = vllm_layers(KVCacheLayout.LBNHC, attention_spec(), device="cuda", seed=None)
    dst = vllm_layers(KVCacheLayout.LBHNC, attention_spec(), device="cuda", seed=None)
    layout = KVLayout(VLLM_AXES, NB)
    saver, loader = KVBlocks(src, layout), KVBlocks(dst, layout)
    assert saver.on_cuda and loader.on_cuda
    g = torch.Generator(device="cuda").manual_seed(8)
    for t in src:  # queued on the compute stream, not waited for: the save must order itself
        t.copy_(torch.randn(t.shape, generator=g, device="cuda").to(DTYPE))

    path = Path("/dev/shm") / f"dss-test-cuda-layouts-{os.getpid()}-{time.monotonic_ns()}.shm"
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
        arena.unlink()


@pytest.mark.gpu
@NEEDS_CUDA
def test_cuda_kernel_blocks_and_mla_round_trip() -> None:
    split = vllm_layers(KVCacheLayout.LBNHC, attention_spec(32), kernel_block_size=16, device="cuda", seed=9)
    whole = vllm_layers(KVCacheLayout.LBHNC, attention_spec(32), device="cuda", seed=None)
    layout = KVLayout(VLLM_AXES, NB)
    round_trip(split, layout, whole, layout)  # an unpinned tensor: correct, only slower
    assert_same_kv(
        [t.cpu() for t in split], vllm_block_kv(kernel_blocks=2), [t.cpu() for t in whole], vllm_block_kv()
    )
    spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=24, dtype=DTYPE)
    src = vllm_layers(KVCacheLayout.LBNHC, spec, device="cuda", seed=10)
    dst = vllm_layers(KVCacheLayout.LBHNC, spec, device="cuda", seed=None)
    round_trip(src, layout, dst, layout)
    mla = vllm_block_kv(mla=True)
    assert_same_kv([t.cpu() for t in src], mla, [t.cpu() for t in dst], mla)
