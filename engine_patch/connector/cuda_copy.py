"""Page copies between KV blocks on a CUDA device and the host arena, off the compute stream.

The host arena is registered with CUDA as page-locked memory (`HostArena.pin`, done by
`ArenaViews(pin=True)` when it attaches an arena), so a copy between it and the device is a DMA
that runs while the host goes on. Each run of consecutive blocks and slots moves in ONE DMA: the
run's slots are one contiguous span of the arena (`[n, num_layers, layer_block_nbytes]`), copied
to or from a device staging buffer of the same bytes; the per-layer conversion between the
engine's layout and the page's canonical form happens on the device, as strided device copies
(see `engine_patch.connector.layouts`). A strided copy straight between device and host memory would make
torch go through an unpinned host temporary, synchronously, once per layer.

Ordering, on a side stream of the engine's device:
- loads: the DMAs, then (after the compute stream's queued work: a forward in flight may still
  write blocks that are being reused) the device copies into the blocks; the compute stream
  waits for them, so the forward that reads the blocks runs after them; and the host waits for
  the DMAs before returning, because the caller checks the slots' generations after the copy,
  and the bytes must have been read by then. A load from another thread than the engine's (the
  worker's async loader) cannot order the engine's stream, whose forward it does not see: it
  waits for the device copies themselves, and the request is reported loaded only after.
- saves: the side stream waits for the compute stream (the forward that wrote the blocks), then
  the device copies into staging, then the DMAs; the host waits for them before returning, so
  the pages are in the arena before the store is told (`commit_save`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from dss.errors import InvalidInput

Fill = Callable[[int, torch.Tensor], None]
"""Device-side copies for run `i` between its staging bytes and the engine's blocks."""


class CudaCopier:
    """Copies for one device, on a side stream of that device."""

    def __init__(self, device: torch.device) -> None:
        """Made on the engine's thread (`register_kv_caches`), whose current stream is the
        compute stream."""
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self._engine_thread = threading.get_ident()
        self._engine_stream = torch.cuda.current_stream(device)

    def _compute_stream(self) -> tuple[torch.cuda.Stream, bool]:
        """The stream the engine computes on, and whether the caller runs on the engine's thread."""
        if threading.get_ident() == self._engine_thread:
            return torch.cuda.current_stream(self.device), True
        return self._engine_stream, False

    def load(self, host_rows: Sequence[torch.Tensor], scatter: Fill) -> None:
        """Host arena -> blocks. `host_rows[i]`: run `i`'s slots (contiguous uint8 host memory);
        `scatter(i, staged)` copies the run's staged bytes (on the device) into the blocks."""
        compute, on_engine_thread = self._compute_stream()
        read = torch.cuda.Event()
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream), self._drained_on_error():
            staged = [self._dma_in(rows) for rows in host_rows]
            read.record(self.stream)
            self.stream.wait_stream(compute)  # blocks reused from a forward still queued
            for i, dev in enumerate(staged):
                scatter(i, dev)
            done.record(self.stream)
        compute.wait_event(done)  # the forward reading these blocks runs after the copies
        # The arena's bytes are read before the caller checks their generations; off the
        # engine's thread, the blocks are written before the load is reported done.
        (read if on_engine_thread else done).synchronize()

    def save(self, host_rows: Sequence[torch.Tensor], gather: Fill) -> None:
        """Blocks -> host arena. `gather(i, staging)` copies run `i`'s blocks into a device
        staging buffer shaped like `host_rows[i]`, which then goes to the arena in one DMA."""
        compute, _ = self._compute_stream()
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream), self._drained_on_error():
            self.stream.wait_stream(compute)  # the forward that wrote the blocks comes first
            for i, rows in enumerate(host_rows):
                _contiguous(rows)
                # Allocated on the side stream: the caching allocator reuses it only for work
                # queued after this on the same stream, so dropping it here is safe.
                dev = torch.empty(rows.shape, dtype=rows.dtype, device=self.device)
                gather(i, dev)
                rows.copy_(dev, non_blocking=True)
            done.record(self.stream)
        done.synchronize()  # the pages are in the arena before the caller commits them

    @contextlib.contextmanager
    def _drained_on_error(self) -> Iterator[None]:
        """On a failure, wait for what was queued: the caller then gives the slots back to the
        store (abort, release), and no DMA may still be reading or writing them."""
        try:
            yield
        except BaseException:
            self.stream.synchronize()
            raise

    def _dma_in(self, rows: torch.Tensor) -> torch.Tensor:
        _contiguous(rows)
        dev = torch.empty(rows.shape, dtype=rows.dtype, device=self.device)
        dev.copy_(rows, non_blocking=True)
        return dev


def _contiguous(rows: torch.Tensor) -> None:
    # A non-contiguous host side would make torch stage the copy through an unpinned temporary,
    # synchronously: one run must be one span of the arena.
    if not rows.is_contiguous() or rows.device.type != "cpu":
        raise InvalidInput("a run's arena slots must be one contiguous span of host memory")
