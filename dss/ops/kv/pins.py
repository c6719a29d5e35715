"""`PublicPins`: the public prefixes of each model whose pages are kept pinned (never evicted).

`set_pins` replaces a model's list (the old prefixes' pages are unpinned first); `apply` pins the
pages the listed prefixes reach now, and runs again after each public save, so pages saved later
are pinned too.

Lock: `PublicPins._lock` is a leaf around the lists; the index and the page table are called
after it is released.
"""

from __future__ import annotations

import threading

import numpy as np

from dss.ops.kv.lookup import KVLookup
from dss.pages.placement import TieredPages
from dss.types import PUBLIC_TENANT, FingerprintId


class PublicPins:
    def __init__(self, lookup: KVLookup, pages: TieredPages) -> None:
        self._lookup = lookup
        self._pages = pages
        self._lock = threading.Lock()
        self._pins: dict[FingerprintId, list[np.ndarray]] = {}

    def set_pins(self, fid: FingerprintId, token_lists: list[np.ndarray]) -> None:
        """The public prefixes of `fid` to keep pinned (their pages are never evicted)."""
        with self._lock:
            old = self._pins.get(fid, [])
            self._pins[fid] = list(token_lists)
        for tokens in old:
            self._pages.table.set_pinned(self._lookup.stored_prefix(fid, PUBLIC_TENANT, tokens).pages, False)
        self.apply(fid)

    def apply(self, fid: FingerprintId) -> None:
        """Pin the pages the prefixes of `fid` reach now."""
        with self._lock:
            token_lists = list(self._pins.get(fid, []))
        for tokens in token_lists:
            self._pages.table.set_pinned(self._lookup.stored_prefix(fid, PUBLIC_TENANT, tokens).pages, True)
