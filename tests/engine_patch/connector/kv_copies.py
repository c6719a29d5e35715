"""Engine KV tensors and round-trip checks shared by the layout tests, with no vLLM import.

`engine_layers` builds the per-layer `[B, H, N, C]` views vLLM 0.32's allocator
(`vllm/v1/worker/utils.py` `allocate_kv_cache`) gives a connector for each `KVCacheLayout`, by
hand: one backing buffer in the layout's physical axis order. Without vLLM's import chain (its
worker utilities pull in the whole serving stack) the CUDA tests run on a machine that has torch
and nothing else (`make test-gpu`); `test_kv_layouts.py` checks, with vLLM on CPU, that these
views have vLLM's shapes and strides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_patch.connector.copy import KVBlocks, runs
from engine_patch.connector.layouts import KVLayout

L, NB, H, BS, D = 3, 12, 4, 16, 8  # layers, blocks, KV heads, block size, head size
DTYPE = torch.bfloat16
BLOCKS, SLOTS = [2, 3, 4, 9, 0, 7], [5, 6, 7, 1, 2, 3]  # runs: 3 consecutive, then three single
TARGETS = [10, 11, 5, 1, 6, 8]  # where the loading engine's blocks are (other runs again)

KV = tuple[torch.Tensor, torch.Tensor | None]  # K [H, N, D] and V (None for MLA's latent)
BlockKV = Callable[[torch.Tensor, int], KV]

# vLLM 0.32's `KVCacheLayout` values (vllm/v1/kv_cache_layout.py): for each physical axis, from
# the outermost, the logical axis of [L, B, H, N, C] stored there.
STRIDE_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def engine_layers(
    layout: str,
    *,
    block_size: int = BS,
    heads: int = H,
    content: int = 2 * D,
    kernel_block_size: int | None = None,
    layers: int = L,
    blocks: int = NB,
    dtype: torch.dtype = DTYPE,
    device: str = "cpu",
    seed: int | None = 0,
) -> list[torch.Tensor]:
    """One `[B, H, N, C]` view per layer over a single buffer laid out as `layout` (C: K then V of
    a token and head, or MLA's latent). With `kernel_block_size`, a manager block is split into
    kernel blocks (`[B * r, H, N / r, C]`), as vLLM does for a layer-compact layout. Random values
    from `seed`, or zeros when it is None."""
    ratio = block_size // (kernel_block_size or block_size)
    shape = (layers, blocks * ratio, heads, block_size // ratio, content)
    order = STRIDE_ORDERS[layout]
    physical = torch.zeros([shape[axis] for axis in order], dtype=dtype, device=device)
    logical = physical.permute([order.index(axis) for axis in range(5)])  # back to [L, B, H, N, C]
    views = [logical[i] for i in range(layers)]
    if seed is not None:
        fill_random(views, seed)
    return views


def fill_random(layers: list[torch.Tensor], seed: int) -> None:
    """Random values in every layer, from `seed` (drawn on the CPU: the same on any device)."""
    g = torch.Generator().manual_seed(seed)
    for t in layers:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def vllm_block_kv(kernel_blocks: int = 1, mla: bool = False, head_size: int = D) -> BlockKV:
    """K and V of manager block `b` in vLLM's `[B*S, H, N/S, C]` view: C is K then V."""

    def kv(t: torch.Tensor, b: int) -> KV:
        block = torch.cat([t[b * kernel_blocks + s] for s in range(kernel_blocks)], dim=1)  # [H, N, C]
        if mla:
            return block, None
        return block[..., :head_size], block[..., head_size:]

    return kv


def arena_pages(layer_block_nbytes: int, n_slots: int = 8, num_layers: int = L) -> torch.Tensor:
    """An arena-like uint8 tensor, `[n_slots, num_layers, layer_block_nbytes]` (as `ArenaViews`)."""
    return torch.full((n_slots, num_layers, layer_block_nbytes), 0xA5, dtype=torch.uint8)


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
