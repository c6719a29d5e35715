"""Reads of what is stored, for one tenant's token sequences: `match`, `residency`, `stored`;
and `forget`, which keeps the index in step with the page table.

No lock of its own: the index and the page table each take their own leaf lock. A page the page
table drops is handed to `forget`, which unlinks it from the index afterwards (index → page
table → index again, never nested).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dss.config import StoreConfig
from dss.errors import LimitExceeded
from dss.index.fingerprints import FingerprintRegistry
from dss.index.prefix_index import PrefixIndex
from dss.ops.kv.matching import MatchInfo, match_info, with_partial
from dss.pages.placement import TieredPages
from dss.tokens import as_tokens
from dss.types import FingerprintId, PageHash, TenantId, Tier


@dataclass(frozen=True, slots=True)
class StoredKV:
    """The KV a tenant's own pages hold for some token sequences: each distinct page once, at
    its uncompressed size (`ModelFingerprint.page_nbytes`), whatever tier holds it."""

    pages: int = 0
    nbytes: int = 0


class KVLookup:
    def __init__(
        self, config: StoreConfig, fingerprints: FingerprintRegistry, index: PrefixIndex, pages: TieredPages
    ) -> None:
        self._max_tokens = config.max_tokens_per_sequence
        self._fingerprints = fingerprints
        self._index = index
        self._pages = pages

    def tokens(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """`tokens` as the store's token array; `LimitExceeded` past the sequence limit."""
        arr = as_tokens(tokens)
        if len(arr) > self._max_tokens:
            raise LimitExceeded(f"{len(arr)} tokens exceed the limit of {self._max_tokens}")
        return arr

    def stored_prefix(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray, touch: bool = True
    ) -> MatchInfo:
        """Longest stored prefix for `tokens` in the tenant's namespace, public prefixes
        included: whole pages, then the page (a tail page, or a whole one) the rest of `tokens`
        shares the most leading tokens with. Pages that left every tier end the match. `touch`:
        counts as a use of those pages (their recency)."""
        bs = self._fingerprints.get(fid).block_size
        m = self._index.match(fid, tenant, self.tokens(tokens), touch=touch)
        n_ok = self._pages.table.present_prefix(with_partial(m))
        return match_info(m, n_ok, bs)

    def residency(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray
    ) -> dict[str, int]:
        """Tokens of `tokens` whose KV each tier holds now. A page on two tiers (host and its
        write-through copy on disk) counts in both."""
        m = self.stored_prefix(fid, tenant, tokens)
        bs = self._fingerprints.get(fid).block_size
        out = {t.value: 0 for t in Tier}
        for h, n in zip(m.pages, m.page_tokens(bs), strict=True):
            for t in self._pages.tiers_of(h):
                out[t.value] += n
        return out

    def stored(
        self, tenant: TenantId, sequences: Iterable[tuple[FingerprintId, Sequence[int] | np.ndarray]]
    ) -> StoredKV:
        """The KV the tenant's own pages hold for these token sequences (a session's versions).
        Public prefix pages are not the tenant's and not counted, nor are sequences of a model
        this store does not know. Leaves the pages' recency alone (a console listing sessions
        must not keep them warm)."""
        seen: set[PageHash] = set()
        nbytes = 0
        for fid, tokens in sequences:
            if fid not in self._fingerprints:
                continue
            fp = self._fingerprints.get(fid)
            info = self.stored_prefix(fid, tenant, tokens, touch=False)
            for h in info.pages[info.public_tokens // fp.block_size :]:
                if h not in seen:
                    seen.add(h)
                    nbytes += fp.page_nbytes
        return StoredKV(len(seen), nbytes)

    def forget(self, gone: Sequence[PageHash]) -> None:
        """Pages that left the page table: unlink them from the index, and drop the pages below
        them that became unreachable."""
        if gone:
            orphans = self._index.unlink(gone)
            if orphans:
                self._pages.copies.drop(orphans)
