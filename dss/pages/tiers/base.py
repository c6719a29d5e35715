"""The contract every page tier implements."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Protocol, runtime_checkable

from dss.errors import CapacityError
from dss.types import PageHash, Tier


@runtime_checkable
class PageTier(Protocol):
    """Opaque page bytes by hash, within a byte capacity.

    `put` never evicts by itself: it raises `CapacityError` when there is no room, and the page
    store (which owns policy) demotes or drops pages and tries again.
    """

    tier: Tier
    capacity_bytes: int

    @property
    def used_bytes(self) -> int: ...

    def contains(self, page: PageHash) -> bool: ...

    def keys(self) -> Iterator[PageHash]: ...

    def delete(self, page: PageHash) -> int:
        """Remove the page; return the bytes freed (0 if absent)."""
        ...


class IndexedTier:
    """What every local backend answers the same way: membership from its own page index, and
    byte accounting against its capacity.

    A backend sets `self._lock` and returns its page → location mapping from `_page_index()`; it
    keeps `_used` (bytes it holds) and `_pending` (bytes reserved by writes in flight) under its
    lock.
    """

    tier: Tier
    capacity_bytes: int
    _lock: threading.Lock | threading.RLock
    _used: int = 0
    _pending: int = 0

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self.capacity_bytes - self._used - self._pending

    def _room_error_locked(self, nbytes: int) -> CapacityError | None:
        """Caller holds the lock: the error to raise when `nbytes` more do not fit, else None."""
        taken = self._used + self._pending
        if taken + nbytes <= self.capacity_bytes:
            return None
        return CapacityError(
            f"{self.tier.value} tier full: {taken} of {self.capacity_bytes} bytes used, {nbytes} asked"
        )

    def _page_index(self) -> Mapping[PageHash, object]:
        raise NotImplementedError

    def contains(self, page: PageHash) -> bool:
        with self._lock:
            return page in self._page_index()

    def __contains__(self, page: PageHash) -> bool:
        return self.contains(page)

    def __len__(self) -> int:
        with self._lock:
            return len(self._page_index())

    def keys(self) -> Iterator[PageHash]:
        with self._lock:
            snapshot = list(self._page_index())
        return iter(snapshot)
