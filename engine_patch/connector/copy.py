"""Whole-page copies between vLLM's KV blocks and the store's shared-memory host arena.

A page is one engine block of every KV layer, layer-major: `[num_layers, layer_row_nbytes]`, where
a layer's row holds one segment per tensor-parallel rank (each rank copies its own; a pipeline
stage copies the layers it runs). Each segment is the rank's block in the page's canonical form
`[H, N, C]`, or, for the CPU backend's ISA-packed blocks, its bytes as they are
(`engine_patch.connector.layouts`). A copy moves runs of consecutive blocks whose slots are consecutive too:
on CPU one strided `copy_` per layer and run, straight between the two memories (no stacked
temporaries, no per-token work); on CUDA one DMA per run and device-side copies per layer
(`engine_patch.connector.cuda_copy`).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dss.errors import InvalidInput
from dss.namespace import LATENT_ROWS_ISA
from dss.pages.tiers.host.arena import HostArena
from engine_patch.connector.layouts import KVLayout, slot_view

if TYPE_CHECKING:
    from engine_patch.connector.cuda_copy import CudaCopier


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
    if len(block_ids) <= _SHORT_RUNS:
        return _runs_of_few(block_ids, slots)
    b = np.asarray(block_ids, dtype=np.int64)
    s = np.asarray(slots, dtype=np.int64)
    cuts = np.flatnonzero((np.diff(b) != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(b)]))
    return [Run(int(b[i]), int(s[i]), int(e - i)) for i, e in zip(starts, ends, strict=True)]


# Up to this many pages a plain loop splits runs faster than numpy's per-call overhead (33 pages:
# 2 us against 14 us idle, several times that on a hot turn's path inside the engine, issue 31);
# a long prompt's thousands of pages take the vectorised path.
_SHORT_RUNS = 256


def _runs_of_few(block_ids: Sequence[int], slots: Sequence[int]) -> list[Run]:
    out: list[Run] = []
    first = 0
    for i in range(1, len(block_ids)):
        if block_ids[i] != block_ids[i - 1] + 1 or slots[i] != slots[i - 1] + 1:
            out.append(Run(int(block_ids[first]), int(slots[first]), i - first))
            first = i
    out.append(Run(int(block_ids[first]), int(slots[first]), len(block_ids) - first))
    return out


class KVBlocks:
    """This rank's KV layers, addressed by block id, and where they go in a page.

    A page is `[num_layers, segments * layer_block_nbytes]`: per model layer, one segment per
    tensor-parallel rank. A rank copies its own segment (`segment`) of the layers it holds
    (`layers`, keyed by model layer index: a pipeline stage holds some of them). `layout` says how
    each layer tensor holds its blocks (`engine_patch.connector.layouts`): copies go between the layers'
    block-major views and the slots' bytes viewed the same way, in the page's canonical form (or
    as they are, for the CPU backend's packed blocks). On a CUDA device the copies of a
    single-segment page run through `engine_patch.connector.cuda_copy` (one DMA per run, on a side stream).
    """

    def __init__(
        self,
        layers: Sequence[torch.Tensor] | Mapping[int, torch.Tensor],
        layout: KVLayout,
        *,
        num_layers: int | None = None,
        segment: int = 0,
        segments: int = 1,
    ) -> None:
        by_index = dict(layers) if isinstance(layers, Mapping) else dict(enumerate(layers))
        if not by_index:
            raise InvalidInput("no KV layers")
        self.num_layers = len(by_index) if num_layers is None else num_layers
        if any(not 0 <= i < self.num_layers for i in by_index):
            raise InvalidInput(f"KV layers {sorted(by_index)} outside the page's {self.num_layers}")
        if not 0 <= segment < segments:
            raise InvalidInput(f"segment {segment} of {segments}")
        first = next(iter(by_index.values()))
        for kv in by_index.values():
            if kv.shape != first.shape or kv.dtype != first.dtype or kv.device != first.device:
                raise InvalidInput("KV layers differ in shape, dtype or device")
        self.layer_indexes = sorted(by_index)
        self.layers = [by_index[i] for i in self.layer_indexes]
        self.segment, self.segments = segment, segments
        self.layout = layout
        self.views = [layout.block_major(kv) for kv in self.layers]  # [num_blocks, *fine_shape]
        self.num_blocks = layout.num_blocks
        self.fine_shape = tuple(int(d) for d in self.views[0].shape[1:])
        self.block_shape = layout.canonical_block_shape(first)  # (H, N, C) of a block in a page
        self.dtype = first.dtype
        self.layer_block_nbytes = math.prod(self.fine_shape) * first.element_size()
        self.on_cuda = first.device.type == "cuda"
        self._cuda: CudaCopier | None = None
        if self.on_cuda and segments == 1 and len(self.layers) == self.num_layers:
            # One DMA per run moves whole slot rows: only for a rank that owns the whole page.
            # A tensor-parallel rank or a pipeline stage owns part of each row; it copies its
            # segments per layer and run (synchronous `copy_` between device and pinned host),
            # so it never overwrites another rank's bytes.
            from engine_patch.connector.cuda_copy import CudaCopier

            self._cuda = CudaCopier(first.device)

    @property
    def page_nbytes(self) -> int:
        return self.num_layers * self.segments * self.layer_block_nbytes

    def _slot_layer(self, pages: torch.Tensor, run: Run, layer: int) -> torch.Tensor:
        """Run `run`'s slots, this rank's segment of its `layer`-th layer, viewed like the engine's
        block-major view (no copy)."""
        lb = self.layer_block_nbytes
        start = self.segment * lb
        raw = pages[run.slot : run.slot + run.n, self.layer_indexes[layer], start : start + lb]
        return slot_view(raw, self.dtype, self.fine_shape)

    def _check(self, pages: torch.Tensor, run_list: Sequence[Run]) -> None:
        row = self.segments * self.layer_block_nbytes
        if pages.dim() != 3 or pages.shape[1:] != (self.num_layers, row):
            raise InvalidInput(f"arena pages {tuple(pages.shape)} do not hold {self.num_layers} x {row}")
        for r in run_list:
            if r.n <= 0 or r.block < 0 or r.block + r.n > self.num_blocks:
                raise InvalidInput(f"blocks {r.block}..{r.block + r.n} out of [0, {self.num_blocks})")
            if r.slot < 0 or r.slot + r.n > pages.shape[0]:
                raise InvalidInput(f"slots {r.slot}..{r.slot + r.n} out of [0, {pages.shape[0]})")

    def load(self, pages: torch.Tensor, run_list: Sequence[Run], layers: Sequence[int] | None = None) -> None:
        """Arena slots -> engine blocks, of `layers` (model layer indexes, those this rank holds;
        default all: a hybrid model's KV cache groups each copy their own layers with their own
        block ids)."""
        self._check(pages, run_list)
        if self._cuda is not None and layers is None:
            self._cuda.load(_run_rows(pages, run_list), self.scatter_from_staging(run_list))
            return
        chosen = self._held(layers)
        for r in run_list:
            for layer in chosen:
                self.views[layer][r.block : r.block + r.n].copy_(self._slot_layer(pages, r, layer))

    def save(self, pages: torch.Tensor, run_list: Sequence[Run], layers: Sequence[int] | None = None) -> None:
        """Engine blocks -> arena slots, of `layers` (as in `load`)."""
        self._check(pages, run_list)
        if self._cuda is not None and layers is None:
            self._cuda.save(_run_rows(pages, run_list), self.gather_to_staging(run_list))
            return
        chosen = self._held(layers)
        for r in run_list:
            for layer in chosen:
                self._slot_layer(pages, r, layer).copy_(self.views[layer][r.block : r.block + r.n])

    def _held(self, layers: Sequence[int] | None) -> Sequence[int]:
        """Positions in `self.views` of model layers `layers` that this rank holds (a pipeline
        stage holds some of a group's layers); all of them for None."""
        if layers is None:
            return range(len(self.views))
        position = {index: i for i, index in enumerate(self.layer_indexes)}
        return [position[index] for index in layers if index in position]

    # A run's staging buffer on the device holds its slots' bytes, `[n, num_layers,
    # layer_row_nbytes]`: it is addressed like the arena from slot 0.
    def scatter_from_staging(self, run_list: Sequence[Run]) -> Callable[[int, torch.Tensor], None]:
        """The device-side half of a CUDA load: `scatter(i, staged)` copies run `i`'s staged slot
        bytes into its blocks. Runs on tensors of any device (CPU in the suite)."""

        def scatter(i: int, staged: torch.Tensor) -> None:
            r = run_list[i]
            for layer, kv in enumerate(self.views):
                kv[r.block : r.block + r.n].copy_(self._slot_layer(staged, Run(r.block, 0, r.n), layer))

        return scatter

    def gather_to_staging(self, run_list: Sequence[Run]) -> Callable[[int, torch.Tensor], None]:
        """The device-side half of a CUDA save: `gather(i, staging)` copies run `i`'s blocks into a
        buffer shaped like its slots, `[n, num_layers, layer_row_nbytes]`."""

        def gather(i: int, staging: torch.Tensor) -> None:
            r = run_list[i]
            for layer, kv in enumerate(self.views):
                self._slot_layer(staging, Run(r.block, 0, r.n), layer).copy_(kv[r.block : r.block + r.n])

        return gather

    def scrub_after(
        self, pages: torch.Tensor, slot: int, valid_tokens: int, isa: str, kv_cache_dtype: str = "auto"
    ) -> None:
        """Zero the token positions from `valid_tokens` on in a copied block (a tail page).

        An engine block is reused without being cleared, so the positions a partial block has
        not reached yet still hold KV of whatever request used the block before, another
        tenant's even; a tail page must not carry them into the store. A canonical page is
        zeroed there directly. A packed (CPU) block interior is overwritten through the CPU
        backend's own cache-write kernel for `isa` (with zero K and V), which touches exactly
        those positions, as decoding does; for an fp8 cache (`kv_cache_dtype`) the kernel
        quantizes the zeros, which are zero bytes whatever the scales.
        """
        self._check(pages, [Run(0, slot, 1)])
        if f"cpu-{isa}" == LATENT_ROWS_ISA:
            self._scrub_latent_rows(pages, slot, valid_tokens)
            return
        n_heads, block_size, width = self.block_shape
        if not 0 < valid_tokens < block_size:
            raise InvalidInput(f"a tail page holds 1..{block_size - 1} tokens, not {valid_tokens}")
        if not self.layout.packed:
            lb, start = self.layer_block_nbytes, self.segment * self.layer_block_nbytes
            for index in self.layer_indexes:
                raw = pages[slot : slot + 1, index, start : start + lb]
                slot_view(raw, self.dtype, self.block_shape)[:, :, valid_tokens:] = 0
            return
        from vllm import _custom_ops as ops

        head_size = width // 2
        n = block_size - valid_tokens
        # K and V to write come in a float dtype: the cache's own, or float32 for an fp8 cache's bytes.
        value_dtype = self.dtype if self.dtype.is_floating_point else torch.float32
        zeros = torch.zeros((n, n_heads, head_size), dtype=value_dtype)
        positions = torch.arange(valid_tokens, block_size, dtype=torch.int64)
        for layer in range(len(self.layers)):
            block = self._slot_layer(pages, Run(0, slot, 1), layer)  # [1, H, N, 2D] over the slot
            key_cache, value_cache = block.view(1, n_heads, 2 * block_size, head_size).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(
                zeros, zeros, key_cache, value_cache, positions, isa, kv_cache_dtype=kv_cache_dtype
            )

    def _scrub_latent_rows(self, pages: torch.Tensor, slot: int, valid_tokens: int) -> None:
        """`scrub_after` for an MLA cache, `[num_blocks, 1, block_size, latent]` (one "KV head"):
        vLLM's CPU MLA backend writes one plain row per token (`CPUMLAImpl.do_kv_cache_update`),
        so the rows from `valid_tokens` on are zeroed directly."""
        block_size = int(self.block_shape[-2])
        if not 0 < valid_tokens < block_size:
            raise InvalidInput(f"a tail page holds 1..{block_size - 1} tokens, not {valid_tokens}")
        for layer in range(len(self.layers)):
            self._slot_layer(pages, Run(0, slot, 1), layer)[0, :, valid_tokens:].zero_()


def _run_rows(pages: torch.Tensor, run_list: Sequence[Run]) -> list[torch.Tensor]:
    """Each run's slots, whole: one contiguous span of the arena per run (one DMA on CUDA)."""
    return [pages[r.slot : r.slot + r.n] for r in run_list]


@dataclass(slots=True)
class Attached:
    """One arena attached in this process: its slots as a `[n_slots, num_layers,
    layer_row_nbytes]` uint8 tensor over the shared memory, and the arena (for generations)."""

    arena: HostArena
    inode: int
    size: int
    pages: torch.Tensor

    def unchanged(self, slots: Sequence[int], generations: Sequence[int]) -> int:
        """How many of `slots`, from the first, still hold the pages the store named (same
        generation): asked after a copy out, whose pages past that count are misses."""
        return self.arena.unchanged(slots, generations)


class ArenaViews:
    """Arenas attached in this process, each seen as a `[n_slots, num_layers, layer_row_nbytes]`
    uint8 tensor over the shared memory.

    An arena file is re-attached when its inode changes: a restarted store recreates the file at
    the same path, and the old mapping must never be read again. Attaching refuses a symlink or a
    file or directory that is not ours and private (`UnsafeSharedMemory`, see `HostArena.attach`).
    With `pin` (a worker whose KV is on a CUDA device) each arena is registered with CUDA as
    page-locked memory when it is attached, for asynchronous DMA, and unregistered when it is closed.
    """

    def __init__(self, num_layers: int, layer_row_nbytes: int, *, pin: bool = False) -> None:
        self.num_layers = num_layers
        self.layer_row_nbytes = layer_row_nbytes
        self.pin = pin
        self._lock = threading.Lock()
        self._arenas: dict[str, Attached] = {}

    def pages(self, path: str, slot_nbytes: int) -> torch.Tensor:
        return self.attached(path, slot_nbytes).pages

    def attached(self, path: str, slot_nbytes: int) -> Attached:
        if slot_nbytes != self.num_layers * self.layer_row_nbytes:
            raise InvalidInput(
                f"arena slots of {slot_nbytes} bytes; pages here are "
                f"{self.num_layers} x {self.layer_row_nbytes}"
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
        if self.pin:
            try:
                arena.pin()  # cudaHostRegister over the whole mapping; `close` unregisters it
            except BaseException:
                arena.close()
                raise
        pages = torch.from_numpy(arena.data()).view(arena.n_slots, self.num_layers, self.layer_row_nbytes)
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
            if not self.pin:  # a registration with CUDA has mapped every page already
                prefault = threading.Thread(target=_prefault, args=(arena,), name="dss-arena-prefault")
                prefault.daemon = True
                prefault.start()
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


def _prefault(arena: HostArena) -> None:
    """Map the arena's slots into this process now, at the lowest priority, so that an engine
    step's first copy into a slot takes no page fault per 4 KiB (`HostArena.prefault`): off the
    steps, on CPU time the engine leaves idle."""
    with contextlib.suppress(OSError):  # a per-thread nice value (Linux); elsewhere as it is
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    arena.prefault()
