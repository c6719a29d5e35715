"""The engine's KV cache groups, as DSS sees them (hybrid models: vLLM's `SupportsHMA`).

vLLM's hybrid KV cache manager gives each group of layers its own block table: full-attention
layers keep a block for every position, sliding-window layers only for the positions their window
still needs (the others are vLLM's null block, id 0). A DSS page stays one engine block of every
KV layer, layer-major by layer index; a layer's part of a page is copied with its own group's
block id, and not at all where that id is the null block.

A page is stored only when every group's block of it held real KV at save time (`complete`), so
any stored page can be loaded into any position: whatever a load needs of a window layer is
there. The scheduler saves a running request's pages before they leave the window
(`SchedulerSide._save_pages_leaving_windows`) so that long answers are complete when they are saved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dss.errors import InvalidInput
from engine_patch.connector.copy import Run, runs

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

NULL_BLOCK = 0  # vLLM's null block: a position a group holds no KV for


class UnsupportedGroups(ValueError):
    """A KV cache group DSS cannot store (state-space, chunked-local, cross-attention, ...)."""


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group: its layers' positions in a page, and its sliding window (0: full)."""

    layers: tuple[int, ...]
    window: int = 0
    extra_retained: int = 0  # vLLM keeps this many tokens below the window too (spec decoding)

    @property
    def kind(self) -> str:
        return f"sliding{self.window}" if self.window else "full"

    def skipped_tokens(self, n_computed: int) -> int:
        """Leading tokens whose blocks vLLM frees once `n_computed` tokens are computed (its
        `get_num_skipped_tokens`)."""
        if not self.window:
            return 0
        return max(0, n_computed - self.window + 1 - self.extra_retained)


@dataclass(frozen=True, slots=True)
class KVGroups:
    groups: tuple[KVGroup, ...]

    @classmethod
    def single(cls, num_layers: int) -> KVGroups:
        return cls((KVGroup(tuple(range(num_layers))),))

    @classmethod
    def of(cls, kv_cache_config: KVCacheConfig, layer_index: Callable[[str], int]) -> KVGroups:
        """The groups of an engine's KV cache config; raises `UnsupportedGroups` for a kind of
        group whose KV is not one attention block per position."""
        from vllm.v1.kv_cache_interface import (
            ChunkedLocalAttentionSpec,
            CrossAttentionSpec,
            EncoderOnlyAttentionSpec,
            FullAttentionSpec,
            MambaSpec,
            SlidingWindowSpec,
        )

        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        names = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        if len(specs) == 1 and not isinstance(specs[0], (SlidingWindowSpec, MambaSpec)):
            return cls.single(len(names[0]))  # what every engine was before hybrid support
        indexes = sorted(layer_index(n) for group in names for n in group)
        if len(set(indexes)) != len(indexes):
            raise UnsupportedGroups("two KV layers share a layer index")
        position = {i: p for p, i in enumerate(indexes)}
        out = []
        for spec, layer_names in zip(specs, names, strict=True):
            layers = tuple(sorted(position[layer_index(n)] for n in layer_names))
            if isinstance(spec, MambaSpec):
                raise UnsupportedGroups(
                    "a hybrid attention/state-space model: its state-space (mamba) layers keep a "
                    "recurrent state, not a KV block per position, which DSS does not store"
                )
            if isinstance(spec, (ChunkedLocalAttentionSpec, CrossAttentionSpec, EncoderOnlyAttentionSpec)):
                raise UnsupportedGroups(f"KV cache groups of kind {type(spec).__name__} are not supported")
            if isinstance(spec, SlidingWindowSpec):
                out.append(KVGroup(layers, int(spec.sliding_window), int(spec.extra_retained_tokens)))
            elif type(spec) is FullAttentionSpec:
                out.append(KVGroup(layers))
            else:
                raise UnsupportedGroups(f"KV cache groups of kind {type(spec).__name__} are not supported")
        return cls(tuple(out))

    @classmethod
    def parse(cls, text: str, num_layers: int) -> KVGroups:
        """Inverse of `describe` ("" is one full-attention group of every layer)."""
        if not text:
            return cls.single(num_layers)  # `num_layers`: the fingerprint's
        out = []
        for part in text.split(";"):
            kind, _, layers = part.partition(":")
            window = int(kind.removeprefix("sliding")) if kind.startswith("sliding") else 0
            out.append(KVGroup(tuple(int(x) for x in layers.split(",")), window))
        return cls(tuple(out))

    def describe(self) -> str:
        """`ModelFingerprint.kv_groups`: "" for one full-attention group (the id such an engine
        always had), else each group as `kind:layer,layer,...` in vLLM's group order."""
        if len(self.groups) == 1 and not self.groups[0].window:
            return ""
        return ";".join(f"{g.kind}:{','.join(map(str, g.layers))}" for g in self.groups)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @property
    def windowed(self) -> tuple[KVGroup, ...]:
        return tuple(g for g in self.groups if g.window)


def complete_prefix(block_ids: Sequence[Sequence[int]], indexes: Sequence[int]) -> int:
    """How many of the pages `indexes`, from the first, have a real block in every group (a page
    with a null block in some group lacks that group's KV: neither it nor the pages after it are
    stored)."""
    for n, i in enumerate(indexes):
        if any(i >= len(ids) or ids[i] == NULL_BLOCK for ids in block_ids):
            return n
    return len(indexes)


def group_runs(
    groups: KVGroups, block_ids: Sequence[Sequence[int]], slots: Sequence[int]
) -> list[tuple[tuple[int, ...], list[Run]]]:
    """For each group, its layers and the runs of (block, slot) pairs to copy: the pages' slots
    paired with the group's block ids, null blocks left out."""
    if len(block_ids) != len(groups.groups):
        raise InvalidInput(f"{len(block_ids)} block id lists for {len(groups.groups)} KV cache groups")
    out = []
    for group, ids in zip(groups.groups, block_ids, strict=True):
        pairs = [(b, s) for b, s in zip(ids, slots, strict=True) if b != NULL_BLOCK]
        out.append((group.layers, runs([b for b, _ in pairs], [s for _, s in pairs])))
    return out
