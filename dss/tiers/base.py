"""The contract every page tier implements."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

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
