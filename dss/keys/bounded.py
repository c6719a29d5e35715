"""A bounded least-recently-used map for the key caches (erasure epochs, unwrapped data keys).

Keys of these caches come from outside (a frontend names its end users freely), so a plain dict
would grow with every id ever seen. Not thread-safe by itself: its owner calls it under its own
leaf lock, and nothing here does I/O (eviction drops the oldest entry from memory; the owner
reads it again from the database when it is needed).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedLru(Generic[K, V]):
    """At most `capacity` entries; `put` of a new key beyond it drops the least recently used."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a cache holds at least one entry (got {capacity})")
        self.capacity = capacity
        self._items: OrderedDict[K, V] = OrderedDict()
        self.evictions = 0  # entries dropped for room, since creation

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: K) -> bool:
        return key in self._items

    def get(self, key: K) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        """Store `value` under `key` (the most recently used now), dropping the least recently
        used entry when that makes one too many."""
        self._items[key] = value
        self._items.move_to_end(key)
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)
            self.evictions += 1

    def pop(self, key: K) -> None:
        self._items.pop(key, None)

    def clear(self) -> None:
        self._items.clear()
