"""How one layer's KV tensor holds the engine's blocks, and the form a block takes in a page.

vLLM 0.32 (its RFC #42082 layouts) gives every attention layer one logical view, `[B, H, N, C]`:
blocks, KV heads, tokens, and the content of one head at one token: K then V (`head_size +
head_size_v` values), or MLA's latent vector (one head, no V). Backends differ only in the
physical order of those axes, the resolved `KVCacheLayout` (LBNHC is FlashAttention's and
FlashInfer's NHD, LBHNC is HND and the CPU backend's, BL.. interleave the layers inside each
block), which the view's strides carry; and a manager block may be split into kernel blocks, the
view then being `[B*S, H, N/S, C]` (`group_kernel_blocks`). vLLM before 0.32 declared other
shapes through `get_kv_cache_shape` (FlashAttention `(2, B, N, H, D)`, FlashInfer `(B, 2, N, H,
D)` with an HND stride order, MLA `(B, N, D)`): a `KVLayout` names any of them by its axes.

A page stores each layer's block in one canonical form, `[H, N, C]` contiguous (head-major, then
tokens, then K and V of that head and token): vLLM's logical order, so a page saved by an engine
of one physical layout loads into an engine of any other (same model, dtype and block size) and
gives the same K and V for every token and head. Head-major also makes a tensor-parallel rank's
heads one contiguous range of the block. The CPU backend is the exception: its kernels pack the
block interior for their ISA (`amx`, `vec`), so its pages carry the block's bytes as they are
(`packed`), and the fingerprint's `isa` keeps them apart from every other engine's.

A layout only ever makes views (`permute`, `unflatten`, `unsqueeze`); the copy between the
engine's block-major view and a slot's canonical view is one strided `copy_` per layer and run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dss.errors import InvalidInput
from dss.namespace import ModelFingerprint

# Axis letters. B: block; S: kernel block inside a block; H: KV head; N: token; C: the content of
# one head at one token (K then V, or MLA's latent); K: K-or-V (size 2) and D: one head's K or V,
# for declarations that give K and V their own axis. A block's canonical order is `_ORDER`.
_ORDER = "BHSNKDC"
VLLM_AXES = "BHNC"  # vLLM's per-layer view (every backend since 0.32)
CANONICAL_FORMAT = "HNC"  # the fingerprint's name for pages in the canonical form


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How a layer tensor of one engine holds its `num_blocks` blocks.

    `axes` names the tensor's dims in order (`VLLM_AXES` for vLLM 0.32's views, "KBNHD" for a
    FlashAttention tensor of older vLLM, ...). `packed`: the block interior is packed by the
    attention kernel, so a page holds the block's bytes as they are and only an engine of the same
    packing may read it; the tensor must then already be block-major (blocks on dim 0).
    """

    axes: str
    num_blocks: int
    packed: bool = False

    def __post_init__(self) -> None:
        axes = self.axes
        if len(set(axes)) != len(axes) or not set(axes) <= set(_ORDER):
            raise InvalidInput(f"KV layout axes {axes!r}: each of {_ORDER!r} at most once")
        if "B" not in axes or "N" not in axes:
            raise InvalidInput(f"KV layout axes {axes!r} name no block (B) or token (N) axis")
        if ("C" in axes) == ("K" in axes or "D" in axes) or ("K" in axes) != ("D" in axes):
            raise InvalidInput(f"KV layout axes {axes!r}: content is either C or K and D")
        if self.num_blocks <= 0:
            raise InvalidInput("a KV layout needs a positive block count")
        if self.packed and axes != VLLM_AXES:
            raise InvalidInput(f"a packed KV layout is copied as it is: axes {VLLM_AXES!r}, not {axes!r}")

    def block_major(self, kv: torch.Tensor) -> torch.Tensor:
        """`kv` viewed as `[num_blocks, ...]` in the canonical axis order (a view, often strided).

        Its trailing dims flatten, in order, to the canonical `[H, N, C]` of one block, so a slot's
        bytes viewed with the same trailing shape (`slot_view`) line up element for element.
        """
        if kv.dim() != len(self.axes):
            raise InvalidInput(f"KV tensor of {kv.dim()} dims, layout {self.axes!r} has {len(self.axes)}")
        t, axes = kv, self.axes
        if "H" not in axes:  # MLA's latent cache: one head
            at = axes.index("N")
            t, axes = t.unsqueeze(at), axes[:at] + "H" + axes[at:]
        b = axes.index("B")
        if t.shape[b] != self.num_blocks:
            # vLLM splits a block into kernel blocks when the backend's kernels take smaller ones;
            # they are consecutive along B (`vllm.v1.kv_cache_interface.group_kernel_blocks`).
            if "S" in axes or self.packed or t.shape[b] % self.num_blocks:
                raise InvalidInput(f"KV tensor has {t.shape[b]} blocks along B, expected {self.num_blocks}")
            t, axes = t.unflatten(b, (self.num_blocks, -1)), axes[: b + 1] + "S" + axes[b + 1 :]
        return t.permute(*sorted(range(len(axes)), key=lambda i: _ORDER.index(axes[i])))

    def canonical_block_shape(self, kv: torch.Tensor) -> tuple[int, int, int]:
        """`(H, N, C)` of one of `kv`'s blocks in a page."""
        fine = tuple(int(d) for d in self.block_major(kv).shape[1:])  # H, [S,] N, then C or K, D
        n_content = 1 if "C" in self.axes else 2
        return fine[0], math.prod(fine[1:-n_content]), math.prod(fine[-n_content:])


def slot_view(raw: torch.Tensor, dtype: torch.dtype, fine_shape: tuple[int, ...]) -> torch.Tensor:
    """`[n, nbytes]` slot bytes (one layer of `n` pages, rows possibly strided) viewed as
    `[n, *fine_shape]` elements of `dtype`: the canonical block, split like the engine's view."""
    return raw.view(dtype).view(raw.shape[0], *fine_shape)


def layout_for(fp: ModelFingerprint, num_blocks: int) -> KVLayout:
    """The layout of a vLLM engine's layers: vLLM's `[B, H, N, C]` view, packed on the CPU backend
    (its fingerprint's isa is the kernel's, `cpu-...`), canonical everywhere else."""
    return KVLayout(VLLM_AXES, num_blocks, packed=fp.isa.startswith("cpu-"))


def physical_order(kv: torch.Tensor, layout: KVLayout) -> str:
    """The engine's axes from outermost to innermost in memory (for logs): "BNHC" for vLLM's
    LBNHC/NHD, "BHNC" for LBHNC/HND, "KBNHD" for an old FlashAttention tensor, ..."""
    strides = tuple(int(s) for s in kv.stride())
    order = sorted(range(kv.dim()), key=lambda i: (-strides[i], i))
    return "".join(layout.axes[i] for i in order)
