"""Tail pages: the partial last page of a stored sequence, indexed beside the radix trie.

A sequence rarely ends on a page boundary. Its last, partial page (a whole engine block's bytes,
valid for its first `k < page_size` tokens) is stored as a *tail page*, keyed by the full page it
follows (its parent, `ROOT_PARENT` for a sequence shorter than one page) and its `k` tokens. The
trie stays page-granular; a match that ends on a full page asks this index for the tail under
that page the query shares the most tokens with (a tail serves any prefix of its tokens), so a
continuation recomputes only its new tokens, and the same prompt asked again only its last one.

A tail never has children: a longer sequence through the same tokens stores a full page (and
maybe a tail of its own below it). Several tails can hang under one parent (the branches of a
session, or the same prefix answered twice); their number per parent is bounded, the oldest goes
first.

Not thread-safe: its owner, `dss.index.prefix_index.PrefixIndex`, calls it under its leaf lock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from dss.tokens import as_tokens
from dss.types import HASH_BYTES, NamespaceId, PageHash

MAX_TAILS_PER_PARENT = 32  # per parent page and namespace


def tail_hash(namespace: NamespaceId, parent: PageHash, tokens: np.ndarray) -> PageHash:
    """The content address of a tail page. Its own personalisation keeps it apart from every
    full-page hash, whatever the tokens."""
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"dss-tail-page")
    h.update(namespace)
    h.update(parent)
    h.update(as_tokens(tokens).tobytes())
    return PageHash(h.digest())


@dataclass(frozen=True, slots=True)
class Tail:
    page: PageHash
    parent: PageHash
    namespace: NamespaceId
    tokens: np.ndarray  # the k valid tokens, 0 < k < page_size

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])


class TailIndex:
    """Every tail page, by parent page and namespace (a tail may follow a page of another
    namespace: a user's short answer after a public prefix)."""

    def __init__(self) -> None:
        # (parent, namespace) -> {tail page: tail}, in insertion order (the oldest first)
        self._groups: dict[tuple[PageHash, NamespaceId], dict[PageHash, Tail]] = {}
        self._under: dict[PageHash, set[NamespaceId]] = {}  # parent -> namespaces with tails under it
        self._tails: dict[PageHash, Tail] = {}

    def __len__(self) -> int:
        return len(self._tails)

    def __contains__(self, page: object) -> bool:
        return page in self._tails

    def iter_pages(self) -> Iterator[PageHash]:
        return iter(list(self._tails))

    def n_tokens(self) -> int:
        return sum(t.n_tokens for t in self._tails.values())

    def match(
        self, parent: PageHash, namespaces: Iterable[NamespaceId], rest: np.ndarray, partial: bool = True
    ) -> tuple[Tail, int] | None:
        """The tail under `parent`, in one of `namespaces`, that `rest` shares the most leading
        tokens with, and how many (`partial=False`: only a tail `rest` starts with whole).

        A tail page serves any prefix of its tokens: the KV of a position depends only on the
        tokens up to it, and vLLM computes the block's positions after the served ones itself
        (a prompt that ends inside a stored tail: the same question asked again, say)."""
        best: tuple[Tail, int] | None = None
        for ns in namespaces:
            for tail in self._groups.get((parent, ns), {}).values():
                n = _common_prefix(rest, tail.tokens)
                if (n == tail.n_tokens or (partial and n > 0)) and (best is None or n > best[1]):
                    best = (tail, n)
        return best

    def add(self, tail: Tail, page_size: int) -> list[PageHash]:
        """Index a tail; returns the tails pushed out (the oldest beyond the per-parent bound)."""
        if not 0 < tail.n_tokens < page_size:
            raise ValueError(f"a tail page holds 1..{page_size - 1} tokens, not {tail.n_tokens}")
        if tail.page in self._tails:
            return []
        group = self._groups.setdefault((tail.parent, tail.namespace), {})
        group[tail.page] = tail
        self._under.setdefault(tail.parent, set()).add(tail.namespace)
        self._tails[tail.page] = tail
        pushed: list[PageHash] = []
        while len(group) > MAX_TAILS_PER_PARENT:
            oldest = next(iter(group))
            self.remove(oldest)
            pushed.append(oldest)
        return pushed

    def remove(self, page: PageHash) -> bool:
        tail = self._tails.pop(page, None)
        if tail is None:
            return False
        key = (tail.parent, tail.namespace)
        group = self._groups[key]
        del group[page]
        if not group:
            del self._groups[key]
            spaces = self._under[tail.parent]
            spaces.discard(tail.namespace)
            if not spaces:
                del self._under[tail.parent]
        return True

    def remove_under(
        self, parents: Iterable[PageHash], namespace: NamespaceId | None = None
    ) -> list[PageHash]:
        """Drop the tails that follow these pages (pages cut from a trie), of every namespace or
        of `namespace` only; returns them."""
        out: list[PageHash] = []
        for parent in parents:
            spaces = self._under.get(parent)
            if not spaces:
                continue
            for ns in [n for n in spaces if namespace is None or n == namespace]:
                spaces.discard(ns)
                for page in self._groups.pop((parent, ns)):
                    del self._tails[page]
                    out.append(page)
            if not spaces:
                del self._under[parent]
        return out

    def remove_namespaces(self, namespaces: set[NamespaceId]) -> list[PageHash]:
        doomed = [t.page for t in self._tails.values() if t.namespace in namespaces]
        for page in doomed:
            self.remove(page)
        return doomed

    def tails(self) -> list[Tail]:
        return list(self._tails.values())

    def check(self, page_size_of: dict[NamespaceId, int]) -> None:
        n = 0
        for (parent, ns), group in self._groups.items():
            if not group:
                raise AssertionError("an empty tail group is kept")
            if len(group) > MAX_TAILS_PER_PARENT:
                raise AssertionError(f"{len(group)} tails under one parent")
            if ns not in self._under.get(parent, ()):
                raise AssertionError("a tail group is missing from the parent registry")
            for page, tail in group.items():
                n += 1
                if self._tails.get(page) is not tail or (tail.parent, tail.namespace) != (parent, ns):
                    raise AssertionError("tail registries disagree")
                size = page_size_of.get(ns)
                if size is not None and not 0 < tail.n_tokens < size:
                    raise AssertionError(f"a tail of {tail.n_tokens} tokens")
        if n != len(self._tails):
            raise AssertionError("a tail is registered without its group")


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m
