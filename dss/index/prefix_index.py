"""The prefix index: one radix trie per namespace (model fingerprint + tenant), behind one lock.

Lock: `PrefixIndex._lock` is a **leaf**. Trie operations are in-memory and short; nothing called
under the lock touches the page table, a tier, the database or a caller. The index may briefly
name a page the page table no longer has (a page dropped between the two): readers always pass
the index's answer through the page table (`present_prefix`, `lease_prefix`), and whoever removes
a page from the table unlinks it here afterwards (`unlink`), so at rest the two agree.

Beside the tries, one `TailIndex` holds the tail pages: the partial last page of a sequence, keyed
by the full page it follows. A match that ends on a full page continues into the page (a tail,
or the trie's next whole page) the query shares the most tokens with; a page cut from a trie
takes the tails under it along.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import numpy as np

from dss.index.hashing import ROOT_PARENT
from dss.index.tails import Tail, TailIndex
from dss.index.trie import RadixTrie
from dss.namespace import make_namespace, public_namespace
from dss.types import PUBLIC_TENANT, FingerprintId, Namespace, NamespaceId, PageHash, TenantId


@dataclass(frozen=True, slots=True)
class IndexMatch:
    pages: tuple[PageHash, ...]  # the longest indexed prefix, own or public, in whole pages
    public_pages: int  # how many of the leading pages the public namespace's trie holds
    # The page after `pages` the query uses part of: a tail page, or a whole page the query
    # leaves (or ends) inside. A page serves any prefix of its tokens.
    partial: PageHash | None = None
    partial_tokens: int = 0  # how many of its tokens the query uses (0 without one)

    def n_tokens(self, block_size: int) -> int:
        return len(self.pages) * block_size + self.partial_tokens


class PrefixIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tries: dict[NamespaceId, RadixTrie] = {}
        self._namespaces: dict[NamespaceId, Namespace] = {}
        self._tails = TailIndex()

    # ------------------------------------------------------------------ queries
    def match(
        self, fid: FingerprintId, tenant: TenantId, tokens: np.ndarray, touch: bool = True
    ) -> IndexMatch:
        """The longer of the tenant's own match and the public namespace's: whole pages, then the
        page (a tail page, or the next whole page) the query shares the most tokens with."""
        pub_id = public_namespace(fid).id
        own_id = make_namespace(fid, tenant).id if tenant != PUBLIC_TENANT else None
        with self._lock:
            pub = self._match_in(pub_id, (pub_id,), tokens, touch)
            own = self._match_in(own_id, (own_id, pub_id), tokens, touch) if own_id is not None else None
        best = own if own is not None and own[2] >= pub[2] else pub
        pages, partial, _ = best
        if partial is None:
            return IndexMatch(pages, len(pub[0]))
        return IndexMatch(pages, len(pub[0]), partial[0], partial[1])

    def _match_in(
        self, ns_id: NamespaceId, spaces: Sequence[NamespaceId], tokens: np.ndarray, touch: bool
    ) -> tuple[tuple[PageHash, ...], tuple[PageHash, int] | None, int]:
        """Whole pages of one trie, the partly used page after them, and the tokens of both.
        Caller holds the lock."""
        trie = self._tries.get(ns_id)
        if trie is None:
            return (), None, 0
        bs = trie.page_size
        m = trie.match(tokens, touch=touch)
        in_trie = trie.next_page(m, tokens)
        tail = self._tail_after(m.pages, spaces, tokens, bs)
        in_tails = (tail[0].page, tail[1]) if tail is not None else None
        partial = max((c for c in (in_trie, in_tails) if c is not None), key=lambda c: c[1], default=None)
        return m.pages, partial, len(m.pages) * bs + (partial[1] if partial else 0)

    def _tail_after(
        self,
        pages: Sequence[PageHash],
        spaces: Sequence[NamespaceId],
        tokens: np.ndarray,
        bs: int,
        partial: bool = True,
    ) -> tuple[Tail, int] | None:
        """The tail after `pages` and how many of its tokens `tokens` uses. Caller holds the lock."""
        if not len(self._tails):
            return None
        parent = pages[-1] if pages else ROOT_PARENT
        rest = tokens[len(pages) * bs : (len(pages) + 1) * bs]
        return self._tails.match(parent, spaces, rest, partial)

    def public_match(self, fid: FingerprintId, tokens: np.ndarray) -> tuple[PageHash, ...]:
        with self._lock:
            trie = self._tries.get(public_namespace(fid).id)
            return tuple(trie.match(tokens, touch=False).pages) if trie is not None else ()

    def indexed_tokens(self) -> int:
        with self._lock:
            return sum(len(t) for t in self._tries.values()) + self._tails.n_tokens()

    def iter_pages(self) -> Iterator[PageHash]:
        """Every indexed page, tails included (a snapshot)."""
        with self._lock:
            pages = [h for t in self._tries.values() for h in t.iter_pages()]
            pages.extend(self._tails.iter_pages())
        return iter(pages)

    def check(self) -> None:
        with self._lock:
            for trie in self._tries.values():
                trie.check()
            self._tails.check({k: t.page_size for k, t in self._tries.items()})
            for tail in self._tails.tails():
                if tail.parent != ROOT_PARENT and not any(tail.parent in t for t in self._tries.values()):
                    raise AssertionError("a tail page follows a page no trie holds")

    # ------------------------------------------------------------------ changes
    def insert(
        self, ns: Namespace, block_size: int, tokens: np.ndarray, pages: Sequence[PageHash]
    ) -> list[PageHash]:
        """Index `pages` for `tokens` in `ns`; when `tokens` end inside a page, the last hash is
        that tail page. A stale path that hashes the same tokens differently (a public prefix
        registered after the user cached the same tokens privately) is cut first; returns the
        pages cut or pushed out that nothing reaches any more (the caller drops them)."""
        if not pages:
            return []
        n_full = len(tokens) // block_size
        has_tail = len(tokens) % block_size != 0
        if len(pages) != n_full + has_tail:
            raise ValueError(f"{len(pages)} page hashes for {len(tokens)} tokens of {block_size}-token pages")
        full = pages[:n_full]
        with self._lock:
            trie = self._tries.get(ns.id)
            if trie is None:
                trie = self._tries[ns.id] = RadixTrie(block_size)
                self._namespaces[ns.id] = ns
            cut: list[PageHash] = []
            if full:
                full_tokens = tokens[: n_full * block_size]
                existing = trie.match(full_tokens, touch=False).pages
                for i, h in enumerate(existing):
                    if i < len(full) and h != full[i]:
                        cut = trie.remove_from(h)
                        break
                trie.insert(full_tokens, full)
                cut.extend(self._tails_under_cut(cut, ns.id))
            if has_tail:
                parent = full[-1] if full else ROOT_PARENT
                tail = Tail(pages[-1], parent, ns.id, tokens[n_full * block_size :])
                cut.extend(self._tails.add(tail, block_size))
            return self._unreached(cut)

    def _tails_under_cut(self, cut: list[PageHash], ns_id: NamespaceId) -> list[PageHash]:
        """Drop the tails under pages cut from `ns_id`'s trie: every namespace's under a page no
        trie holds any more, only `ns_id`'s under a page another trie still holds (a public page
        at the head of a private path). Caller holds the lock."""
        held = {p for p in cut if any(p in t for t in self._tries.values())}
        gone = [p for p in cut if p not in held]
        return [*self._tails.remove_under(gone), *self._tails.remove_under(held, ns_id)]

    def unlink(self, gone: Sequence[PageHash]) -> list[PageHash]:
        """Cut pages that left the page table (and everything below them) out of every trie.
        Returns the pages cut below them that no trie reaches any more: they are unreachable,
        and the caller drops them."""
        orphans: list[PageHash] = []
        gone_set = set(gone)
        with self._lock:
            cut: list[PageHash] = []
            for h in gone:
                if self._tails.remove(h):
                    continue
                for trie in self._tries.values():
                    if h in trie:
                        cut.extend(trie.remove_from(h))
            orphans.extend(p for p in cut if p not in gone_set)
            orphans.extend(p for p in self._tails.remove_under([*gone_set, *cut]) if p not in gone_set)
            return self._unreached(orphans)

    def path_pages(self, ns: Namespace, tokens: np.ndarray) -> frozenset[PageHash]:
        """The pages of the namespace's trie on the path of `tokens`, and the tail page that ends
        it (what `remove_paths` keeps for a path that stays)."""
        with self._lock:
            trie = self._tries.get(ns.id)
            if trie is None:
                return frozenset()
            pages = set(trie.match(tokens, touch=False).pages)
            tail = self._tail_of_path(trie, tokens, (ns.id,), trie.page_size)
        if tail is not None:
            pages.add(tail)
        return frozenset(pages)

    def remove_paths(
        self, ns: Namespace, drop: Sequence[np.ndarray], keep: AbstractSet[PageHash]
    ) -> list[PageHash]:
        """Cut the namespace's pages on the paths of `drop` that are not in `keep` (the
        `path_pages` of the paths that stay: a deleted session's, against the user's other
        sessions). Public pages stay. Returns the cut pages no trie reaches any more."""
        pub_id = public_namespace(ns.fingerprint).id
        with self._lock:
            trie = self._tries.get(ns.id)
            if trie is None:
                return []
            public = self._tries.get(pub_id)
            spaces = (ns.id,)
            bs = trie.page_size
            removed: list[PageHash] = []
            for tokens in drop:
                tail = self._tail_of_path(trie, tokens, spaces, bs)
                if tail is not None and tail not in keep and self._tails.remove(tail):
                    removed.append(tail)
                for h in trie.match(tokens, touch=False).pages:
                    if h in keep or h not in trie or (public is not None and h in public):
                        continue
                    # The first private page of the path that no kept path shares: it and
                    # everything below it belong to dropped paths only.
                    cut = trie.remove_from(h)
                    removed.extend(cut)
                    removed.extend(self._tails.remove_under(cut))
                    break
            return self._unreached(removed)

    def _tail_of_path(
        self, trie: RadixTrie, tokens: np.ndarray, spaces: Sequence[NamespaceId], bs: int
    ) -> PageHash | None:
        """Caller holds the lock."""
        found = self._tail_after(trie.match(tokens, touch=False).pages, spaces, tokens, bs, partial=False)
        return found[0].page if found is not None else None

    def drop_tenant(self, tenant: TenantId) -> None:
        """Forget every trie of the tenant (erasure)."""
        with self._lock:
            doomed = {k for k, ns in self._namespaces.items() if ns.tenant == tenant}
            for ns_id in doomed:
                self._tries.pop(ns_id, None)
                self._namespaces.pop(ns_id, None)
            self._tails.remove_namespaces(doomed)

    def _unreached(self, pages: list[PageHash]) -> list[PageHash]:
        """Caller holds the lock."""
        return [p for p in pages if p not in self._tails and not any(p in t for t in self._tries.values())]
