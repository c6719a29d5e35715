"""Whole-page copies between vLLM's KV blocks and the store's shared-memory host arena.

A page is one engine block of every KV layer, layer-major: `[num_layers, layer_block_nbytes]`.
vLLM's per-layer cache has blocks on dim 0 (`[num_blocks, H, N, C]` on CPU, where the block
interior is ISA-packed and only whole blocks mean anything). A copy moves runs of consecutive
blocks whose slots are consecutive too, one strided `copy_` per layer and run, straight between
the two memories: no stacked temporaries, no per-token work.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dss.errors import InvalidInput
from dss.pages.tiers.host import HostArena


@dataclass(frozen=True, slots=True)
class Run:
    """`n` consecutive engine blocks from `block` and arena slots from `slot`."""

    block: int
    slot: int
    n: int


def runs(block_ids: Sequence[int], slots: Sequence[int]) -> list[Run]:
    """Split paired block ids and slot numbers into maximal runs where both step by one."""
    if len(block_ids) != len(slots):
        raise InvalidInput(f"{len(block_ids)} blocks but {len(slots)} slots")
    if not block_ids:
        return []
    b = np.asarray(block_ids, dtype=np.int64)
    s = np.asarray(slots, dtype=np.int64)
    cuts = np.flatnonzero((np.diff(b) != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(b)]))
    return [Run(int(b[i]), int(s[i]), int(e - i)) for i, e in zip(starts, ends, strict=True)]


class KVBlocks:
    """The engine's KV layers (ordered by layer index), addressed by block id."""

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        if not layers:
            raise InvalidInput("no KV layers")
        first = layers[0]
        for kv in layers:
            if kv.shape != first.shape or kv.dtype != first.dtype:
                raise InvalidInput("KV layers differ in shape or dtype")
        self.layers = list(layers)
        self.num_blocks = int(first.shape[0])
        self.block_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self.layer_block_nbytes = first[0].numel() * first.element_size()

    @property
    def page_nbytes(self) -> int:
        return len(self.layers) * self.layer_block_nbytes

    def _slot_layer(self, pages: torch.Tensor, run: Run, layer: int) -> torch.Tensor:
        """Run `run`'s slots, layer `layer`, viewed like the engine's blocks (no copy)."""
        raw = pages[run.slot : run.slot + run.n, layer]  # [n, layer_block_nbytes] uint8, strided
        return raw.view(self.dtype).view(run.n, *self.block_shape)

    def _check(self, pages: torch.Tensor, run_list: Sequence[Run]) -> None:
        if pages.dim() != 3 or pages.shape[1:] != (len(self.layers), self.layer_block_nbytes):
            raise InvalidInput(
                f"arena pages {tuple(pages.shape)} do not hold {len(self.layers)} x {self.layer_block_nbytes}"
            )
        for r in run_list:
            if r.n <= 0 or r.block < 0 or r.block + r.n > self.num_blocks:
                raise InvalidInput(f"blocks {r.block}..{r.block + r.n} out of [0, {self.num_blocks})")
            if r.slot < 0 or r.slot + r.n > pages.shape[0]:
                raise InvalidInput(f"slots {r.slot}..{r.slot + r.n} out of [0, {pages.shape[0]})")

    def load(self, pages: torch.Tensor, run_list: Sequence[Run], layers: Sequence[int] | None = None) -> None:
        """Arena slots -> engine blocks, of `layers` (positions in a page; default all: a hybrid
        model's KV cache groups each copy their own layers with their own block ids)."""
        self._check(pages, run_list)
        chosen = range(len(self.layers)) if layers is None else layers
        for r in run_list:
            for layer in chosen:
                self.layers[layer][r.block : r.block + r.n].copy_(self._slot_layer(pages, r, layer))

    def save(self, pages: torch.Tensor, run_list: Sequence[Run], layers: Sequence[int] | None = None) -> None:
        """Engine blocks -> arena slots, of `layers` (as in `load`)."""
        self._check(pages, run_list)
        chosen = range(len(self.layers)) if layers is None else layers
        for r in run_list:
            for layer in chosen:
                self._slot_layer(pages, r, layer).copy_(self.layers[layer][r.block : r.block + r.n])

    def scrub_after(self, pages: torch.Tensor, slot: int, valid_tokens: int, isa: str) -> None:
        """Zero the token positions from `valid_tokens` on in a copied block (a tail page).

        An engine block is reused without being cleared, so the positions a partial block has
        not reached yet still hold KV of whatever request used the block before, another
        tenant's even; a tail page must not carry them into the store. The block interior is
        ISA-packed, so the positions are overwritten through the CPU backend's own cache-write
        kernel (with zero K and V), which touches exactly those positions, as decoding does.
        """
        from vllm import _custom_ops as ops

        self._check(pages, [Run(0, slot, 1)])
        n_heads, block_size, width = (int(d) for d in self.block_shape)
        if not 0 < valid_tokens < block_size:
            raise InvalidInput(f"a tail page holds 1..{block_size - 1} tokens, not {valid_tokens}")
        head_size = width // 2
        n = block_size - valid_tokens
        zeros = torch.zeros((n, n_heads, head_size), dtype=self.dtype)
        positions = torch.arange(valid_tokens, block_size, dtype=torch.int64)
        for layer in range(len(self.layers)):
            block = self._slot_layer(pages, Run(0, slot, 1), layer)  # [1, H, N, 2D] over the slot
            key_cache, value_cache = block.view(1, n_heads, 2 * block_size, head_size).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(zeros, zeros, key_cache, value_cache, positions, isa)


@dataclass(slots=True)
class Attached:
    """One arena attached in this process: its slots as a `[n_slots, num_layers,
    layer_block_nbytes]` uint8 tensor over the shared memory, and the arena (for generations)."""

    arena: HostArena
    inode: int
    size: int
    pages: torch.Tensor

    def unchanged(self, slots: Sequence[int], generations: Sequence[int]) -> int:
        """How many of `slots`, from the first, still hold the pages the store named (same
        generation): asked after a copy out, whose pages past that count are misses."""
        return self.arena.unchanged(slots, generations)


class ArenaViews:
    """Arenas attached in this process, each seen as a `[n_slots, num_layers, layer_block_nbytes]`
    uint8 tensor over the shared memory.

    An arena file is re-attached when its inode changes: a restarted store recreates the file at
    the same path, and the old mapping must never be read again. Attaching refuses a symlink or a
    file or directory that is not ours and private (`UnsafeSharedMemory`, see `HostArena.attach`).
    """

    def __init__(self, num_layers: int, layer_block_nbytes: int) -> None:
        self.num_layers = num_layers
        self.layer_block_nbytes = layer_block_nbytes
        self._lock = threading.Lock()
        self._arenas: dict[str, Attached] = {}

    def pages(self, path: str, slot_nbytes: int) -> torch.Tensor:
        return self.attached(path, slot_nbytes).pages

    def attached(self, path: str, slot_nbytes: int) -> Attached:
        if slot_nbytes != self.num_layers * self.layer_block_nbytes:
            raise InvalidInput(
                f"arena slots of {slot_nbytes} bytes; pages here are "
                f"{self.num_layers} x {self.layer_block_nbytes}"
            )
        st = os.lstat(path)  # not following a symlink: one is refused by the attach below
        with self._lock:
            entry = self._arenas.get(path)
            if entry is not None and (entry.inode, entry.size) == (st.st_ino, st.st_size):
                return entry
            self._arenas.pop(path, None)
        if entry is not None:
            entry.arena.close()
        # Attaching (open, checks, mmap) runs outside the lock; the slot count is in the file.
        # The entry is keyed by the file actually mapped (its inode), not by the lstat above.
        arena = HostArena.attach(path, slot_nbytes)
        pages = torch.from_numpy(arena.data()).view(arena.n_slots, self.num_layers, self.layer_block_nbytes)
        fresh = Attached(arena, arena.inode, arena.file_nbytes, pages)
        with self._lock:
            entry = self._arenas.get(path)
            if entry is not None and (entry.inode, entry.size) == (fresh.inode, fresh.size):
                keep = entry  # another thread attached the same file meanwhile
            else:
                self._arenas[path] = keep = fresh
            others = [(p, e) for p, e in self._arenas.items() if p != path]
        if keep is not fresh:
            arena.close()
        elif entry is not None:
            entry.arena.close()
        if keep is fresh:
            self._drop_gone(others)
        return keep

    def _drop_gone(self, entries: list[tuple[str, Attached]]) -> None:
        """Unmap arenas whose file is gone (a restarted store makes its arenas in a new directory):
        the mapping alone keeps an unlinked arena's memory allocated in /dev/shm."""
        gone = []
        for path, e in entries:
            try:
                if os.lstat(path).st_ino == e.inode:
                    continue
            except FileNotFoundError:
                pass
            except OSError:
                continue
            gone.append((path, e))
        if not gone:
            return
        with self._lock:
            for path, e in gone:
                if self._arenas.get(path) is e:
                    del self._arenas[path]
        for _, e in gone:
            with contextlib.suppress(Exception):
                e.arena.close()

    def close(self) -> None:
        with self._lock:
            entries = list(self._arenas.values())
            self._arenas.clear()
        for e in entries:
            with contextlib.suppress(Exception):
                e.arena.close()
