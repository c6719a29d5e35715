"""The device tier: pages as uint8 torch tensors on an accelerator (or the CPU where there is none).

It lives in the process that owns the device memory (the engine's worker). Pages are copied in
whole; deleting one zeroes its tensor before the memory goes back to the allocator, which may hand
it to another tensor of this process.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping

import numpy as np
import torch

from dss.errors import CapacityError, InvalidInput, PageMissing
from dss.pages.tiers.base import IndexedTier
from dss.types import Buffer, PageHash, Tier


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _as_uint8_tensor(data: Buffer | np.ndarray | torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of `data` without copying."""
    if isinstance(data, torch.Tensor):
        return data.contiguous().reshape(-1).view(torch.uint8)
    if isinstance(data, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    with warnings.catch_warnings():
        # Read-only buffers (bytes) are fine: the tensor is only ever a copy source.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


class DeviceTier(IndexedTier):
    tier = Tier.DEVICE

    def __init__(self, capacity_bytes: int, device: str | None = None) -> None:
        if capacity_bytes < 0:
            raise InvalidInput("capacity must not be negative")
        self.capacity_bytes = capacity_bytes
        self.device = torch.device(device or default_device())
        self._lock = threading.Lock()
        self._pages: dict[PageHash, torch.Tensor] = {}
        self._used = 0
        self._pending = 0

    def put(
        self, page: PageHash, data: Buffer | np.ndarray | torch.Tensor, non_blocking: bool = False
    ) -> int:
        """Copy the page onto the device; returns its size. A page already present is left as is.

        `non_blocking=True` only helps from pinned host memory; the caller then synchronises the
        current stream before the source changes.
        """
        src = _as_uint8_tensor(data)
        nbytes = int(src.numel())
        with self._lock:
            if page in self._pages:
                return int(self._pages[page].numel())
            if self._used + self._pending + nbytes > self.capacity_bytes:
                raise CapacityError(
                    f"device tier full: {self._used + self._pending} of {self.capacity_bytes} bytes used, "
                    f"{nbytes} asked"
                )
            self._pending += nbytes
        try:
            dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            dst.copy_(src, non_blocking=non_blocking)
        finally:
            with self._lock:
                self._pending -= nbytes
        with self._lock:
            if page in self._pages:  # a concurrent put of the same page won
                return nbytes
            self._pages[page] = dst
            self._used += nbytes
        return nbytes

    def get(self, page: PageHash) -> torch.Tensor:
        """The stored tensor itself (no copy): callers copy out of it and never write into it."""
        with self._lock:
            tensor = self._pages.get(page)
        if tensor is None:
            raise PageMissing(f"page {page.hex()} is not in the device tier")
        return tensor

    def delete(self, page: PageHash) -> int:
        with self._lock:
            tensor = self._pages.pop(page, None)
            if tensor is None:
                return 0
            self._used -= int(tensor.numel())
        tensor.zero_()
        return int(tensor.numel())

    def _page_index(self) -> Mapping[PageHash, object]:
        return self._pages

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self.capacity_bytes - self._used - self._pending
