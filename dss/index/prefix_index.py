"""The prefix index: one radix trie per namespace (model fingerprint + tenant), behind one lock.

Lock: `PrefixIndex._lock` is a **leaf**. Trie operations are in-memory and short; nothing called
under the lock touches the page table, a tier, the database or a caller. The index may briefly
name a page the page table no longer has (a page dropped between the two): readers always pass
the index's answer through the page table (`present_prefix`, `lease_prefix`), and whoever removes
a page from the table unlinks it here afterwards (`unlink`), so at rest the two agree.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from dss.index.trie import RadixTrie
from dss.namespace import make_namespace, public_namespace
from dss.types import PUBLIC_TENANT, FingerprintId, Namespace, NamespaceId, PageHash, TenantId


@dataclass(frozen=True, slots=True)
class IndexMatch:
    pages: tuple[PageHash, ...]  # the longest indexed prefix, own or public, in whole pages
    public_pages: int  # how many of the leading pages the public namespace's trie holds


class PrefixIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tries: dict[NamespaceId, RadixTrie] = {}
        self._namespaces: dict[NamespaceId, Namespace] = {}

    # ------------------------------------------------------------------ queries
    def match(
        self, fid: FingerprintId, tenant: TenantId, tokens: np.ndarray, touch: bool = True
    ) -> IndexMatch:
        """The longer of the tenant's own match and the public namespace's."""
        pub_id = public_namespace(fid).id
        own_id = make_namespace(fid, tenant).id if tenant != PUBLIC_TENANT else None
        with self._lock:
            pub_trie = self._tries.get(pub_id)
            pub = pub_trie.match(tokens, touch=touch).pages if pub_trie is not None else ()
            own_trie = self._tries.get(own_id) if own_id is not None else None
            own = own_trie.match(tokens, touch=touch).pages if own_trie is not None else ()
        best = own if len(own) >= len(pub) else pub
        return IndexMatch(tuple(best), len(pub))

    def public_match(self, fid: FingerprintId, tokens: np.ndarray) -> tuple[PageHash, ...]:
        with self._lock:
            trie = self._tries.get(public_namespace(fid).id)
            return tuple(trie.match(tokens, touch=False).pages) if trie is not None else ()

    def indexed_tokens(self) -> int:
        with self._lock:
            return sum(len(t) for t in self._tries.values())

    def iter_pages(self) -> Iterator[PageHash]:
        """Every indexed page (a snapshot)."""
        with self._lock:
            pages = [h for t in self._tries.values() for h in t.iter_pages()]
        return iter(pages)

    def check(self) -> None:
        with self._lock:
            for trie in self._tries.values():
                trie.check()

    # ------------------------------------------------------------------ changes
    def insert(
        self, ns: Namespace, block_size: int, tokens: np.ndarray, pages: Sequence[PageHash]
    ) -> list[PageHash]:
        """Index `pages` for `tokens` in `ns`. A stale path that hashes the same tokens
        differently (a public prefix registered after the user cached the same tokens privately)
        is cut first; returns the cut pages no trie reaches any more (the caller drops them)."""
        if not pages:
            return []
        with self._lock:
            trie = self._tries.get(ns.id)
            if trie is None:
                trie = self._tries[ns.id] = RadixTrie(block_size)
                self._namespaces[ns.id] = ns
            existing = trie.match(tokens, touch=False).pages
            cut: list[PageHash] = []
            for i, h in enumerate(existing):
                if i < len(pages) and h != pages[i]:
                    cut = trie.remove_from(h)
                    break
            trie.insert(tokens, pages)
            return self._unreached(cut)

    def unlink(self, gone: Sequence[PageHash]) -> list[PageHash]:
        """Cut pages that left the page table (and everything below them) out of every trie.
        Returns the pages cut below them that no trie reaches any more: they are unreachable,
        and the caller drops them."""
        orphans: list[PageHash] = []
        gone_set = set(gone)
        with self._lock:
            for h in gone:
                for trie in self._tries.values():
                    if h in trie:
                        orphans.extend(p for p in trie.remove_from(h) if p not in gone_set)
            return self._unreached(orphans)

    def remove_paths(
        self, ns: Namespace, drop: Sequence[np.ndarray], keep: Sequence[np.ndarray]
    ) -> list[PageHash]:
        """Cut the namespace's pages on the paths of `drop` that no path of `keep` uses (a
        deleted session). Public pages stay. Returns the cut pages no trie reaches any more."""
        pub_id = public_namespace(ns.fingerprint).id
        with self._lock:
            trie = self._tries.get(ns.id)
            if trie is None:
                return []
            public = self._tries.get(pub_id)
            kept = {h for t in keep for h in trie.match(t, touch=False).pages}
            removed: list[PageHash] = []
            for tokens in drop:
                for h in trie.match(tokens, touch=False).pages:
                    if h in kept or h not in trie or (public is not None and h in public):
                        continue
                    # The first private page of the path that no kept path shares: it and
                    # everything below it belong to dropped paths only.
                    removed.extend(trie.remove_from(h))
                    break
            return self._unreached(removed)

    def drop_tenant(self, tenant: TenantId) -> None:
        """Forget every trie of the tenant (erasure)."""
        with self._lock:
            for ns_id in [k for k, ns in self._namespaces.items() if ns.tenant == tenant]:
                self._tries.pop(ns_id, None)
                self._namespaces.pop(ns_id, None)

    def _unreached(self, pages: list[PageHash]) -> list[PageHash]:
        """Caller holds the lock."""
        return [p for p in pages if not any(p in t for t in self._tries.values())]
