"""KV layouts: a page saved from one attention layout loads into another layout of the same model
with the same K and V for every token and head (`engine_patch.connector.layouts`, `KVBlocks`).

vLLM 0.32's layer tensors are made by vLLM's own allocator (`allocate_kv_cache`, the function its
GPU model runner calls) for each `KVCacheLayout`, from real `FullAttentionSpec`/`MLAAttentionSpec`
objects, on CPU tensors. The K/V-split shapes older vLLM backends declared through
`get_kv_cache_shape` (no longer in 0.32's backends) are built here by hand, each with the file it
came from. The CUDA path is in `test_cuda_copy.py`, on views built by hand
(`kv_copies.engine_layers`); `test_hand_built_views_are_vllms` below holds them to vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable
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
from engine_patch.connector.copy import KVBlocks, Run, runs
from engine_patch.connector.fingerprint import _layout_name, attention_isa, check_layer_tensors
from engine_patch.connector.layouts import CANONICAL_FORMAT, VLLM_AXES, KVLayout, layout_for, physical_order
from tests.engine_patch.connector.kv_copies import (
    BLOCKS,
    BS,
    DTYPE,
    KV,
    NB,
    SLOTS,
    STRIDE_ORDERS,
    TARGETS,
    BlockKV,
    D,
    H,
    L,
    arena_pages,
    assert_same_kv,
    engine_layers,
    fill_random,
    round_trip,
    vllm_block_kv,
)


# ------------------------------------------------------------------ engines of each layout
def attention_spec(block_size: int = BS) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=H, head_size=D, dtype=DTYPE)


def vllm_layers(
    layout: KVCacheLayout,
    spec: AttentionSpec,
    *,
    kernel_block_size: int | None = None,
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
    caches = allocate_kv_cache(config, torch.device("cpu"), layout, kernel)
    layers = [caches[n] for n in names]
    if seed is not None:
        fill_random(layers, seed)
    return layers


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
LAYOUTS = list(KVCacheLayout)


def test_hand_built_views_are_vllms() -> None:
    """The views the CUDA tests build without vLLM (`engine_layers`) have the shapes, strides and
    offsets of vLLM's own allocator's, for every layout, a kernel-block split and MLA's latent."""
    assert {m.name: m.value for m in KVCacheLayout} == STRIDE_ORDERS
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=24, dtype=DTYPE)
    cases: list[tuple[KVCacheLayout, AttentionSpec, int | None, int, int]] = [
        *((m, attention_spec(), None, H, 2 * D) for m in KVCacheLayout),
        (KVCacheLayout.LBNHC, attention_spec(32), 16, H, 2 * D),
        (KVCacheLayout.LBNHC, mla, None, 1, 24),
        (KVCacheLayout.LBHNC, mla, None, 1, 24),
    ]
    for layout, spec, kernel, heads, content in cases:
        theirs = vllm_layers(layout, spec, kernel_block_size=kernel, seed=None)
        ours = engine_layers(
            layout.name,
            block_size=spec.block_size,
            heads=heads,
            content=content,
            kernel_block_size=kernel,
            seed=None,
        )
        base_theirs, base_ours = theirs[0].data_ptr(), ours[0].data_ptr()
        for a, b in zip(theirs, ours, strict=True):
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), (layout.name, kernel)
            assert a.data_ptr() - base_theirs == b.data_ptr() - base_ours, (layout.name, kernel)


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
