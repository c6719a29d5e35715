"""The token radix trie: one index per namespace from token prefixes to the page hashes that hold their KV.

The trie is page-granular: every edge key is a whole number of pages (`page_size` tokens each) and
only full pages are indexed. A node's children are keyed by the bytes of their first page, so a
descent is one dict lookup plus one vectorised comparison per node; the number of Python-level
steps depends on the number of nodes on the path, never on the number of tokens.

The trie only indexes; it protects nothing. Pages in use are held by the page table's leases, and
`remove_from` always cuts what it is asked to. The tree stays compressed: no node other than the
root has exactly one child (a removal that leaves one merges the two).

The trie is not thread-safe: its owner, `dss.index.prefix_index.PrefixIndex`, calls it only under
its own leaf lock.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from dss.errors import InvalidInput, NotFoundError
from dss.tokens import TOKEN_DTYPE, as_tokens
from dss.types import HASH_BYTES, PageHash

_EMPTY_KEY = np.empty(0, dtype=TOKEN_DTYPE)
_MAX_PARTIAL_CANDIDATES = 256  # children compared when a match may continue into part of a page


@dataclass(slots=True, eq=False)
class Node:
    """One edge of the radix tree: `key` tokens whose pages are `pages`, in order."""

    key: np.ndarray
    pages: list[PageHash]
    parent: Node | None
    children: dict[bytes, Node] = field(default_factory=dict)
    last_access: float = 0.0
    hit_count: int = 0

    @property
    def n_pages(self) -> int:
        return len(self.pages)


@dataclass(frozen=True, slots=True)
class TrieMatch:
    """The longest indexed prefix of a query, in whole pages.

    `node` is the node holding the last matched page (the root when nothing matched); it may also
    hold unmatched pages after the match. It is there for structural checks (tests, the bench's
    depth count); production callers use `n_tokens` and `pages`.
    """

    n_tokens: int
    pages: tuple[PageHash, ...]
    node: Node
    node_pages: int = 0  # how many of `node`'s pages the match used

    @property
    def n_pages(self) -> int:
        return len(self.pages)


class RadixTrie:
    """Compressed radix tree over token ids, one page (`page_size` tokens) per value."""

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise InvalidInput(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.root = Node(key=_EMPTY_KEY, pages=[], parent=None)
        # hash -> node holding it. The position inside the node is found with list.index only by
        # remove_from, whose cost is already linear in the node; a (node, index) tuple per page
        # would cost ~80 bytes more per page (5 bytes per token at page_size 16).
        self._index: dict[PageHash, Node] = {}
        self._n_nodes = 0

    # --- queries ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._index) * self.page_size

    @property
    def n_pages(self) -> int:
        return len(self._index)

    @property
    def n_nodes(self) -> int:
        """Nodes other than the root."""
        return self._n_nodes

    def __contains__(self, page: object) -> bool:
        return page in self._index

    def match(self, tokens: Sequence[int] | np.ndarray, touch: bool = True) -> TrieMatch:
        """Longest indexed prefix of `tokens` made of whole pages; never restructures the tree."""
        toks = as_tokens(tokens)
        ps = self.page_size
        end = len(toks) - len(toks) % ps
        now = time.monotonic() if touch else 0.0
        node = self.root
        deepest = self.root
        deepest_pages = 0
        pos = 0
        pages: list[PageHash] = []
        while pos < end:
            child = node.children.get(toks[pos : pos + ps].tobytes())
            if child is None:
                break
            matched = self._edge_match(child.key, toks, pos, end)
            n = matched // ps
            pages.extend(child.pages if n == len(child.pages) else child.pages[:n])
            deepest, deepest_pages = child, n
            if touch:
                child.last_access = now
                child.hit_count += 1
            pos += matched
            if matched < len(child.key):
                break
            node = child
        return TrieMatch(n_tokens=pos, pages=tuple(pages), node=deepest, node_pages=deepest_pages)

    def next_page(self, m: TrieMatch, tokens: Sequence[int] | np.ndarray) -> tuple[PageHash, int] | None:
        """The indexed page right after match `m` that the rest of `tokens` shares the most
        leading tokens with (fewer than a page: `m` stopped before it), and how many; None when
        none shares any. A page serves any prefix of its tokens: the KV of a position depends
        only on the tokens up to it."""
        ps = self.page_size
        rest = as_tokens(tokens)[m.n_tokens : m.n_tokens + ps]
        if not len(rest):
            return None
        node = m.node
        if m.node_pages < len(node.pages):  # the match stopped inside this node's pages
            at = m.node_pages * ps
            candidates = [(node.pages[m.node_pages], node.key[at : at + ps])]
        elif len(node.children) <= _MAX_PARTIAL_CANDIDATES:
            candidates = [(c.pages[0], c.key[:ps]) for c in node.children.values()]
        else:
            return None  # a node this wide is a root of many sessions: not worth a scan per match
        best: tuple[PageHash, int] | None = None
        for page, key in candidates:
            m_len = min(len(rest), len(key))
            diff = np.flatnonzero(key[:m_len] != rest[:m_len])
            n = int(diff[0]) if len(diff) else m_len
            if n and (best is None or n > best[1]):
                best = (page, n)
        return best

    def iter_pages(self) -> Iterator[PageHash]:
        """Every indexed page, parents before children."""
        for node in self._nodes():
            yield from node.pages

    def nbytes(self) -> int:
        """Estimate of the index's own memory (nodes, keys, page lists, hash objects, dicts)."""
        per_node = (
            sys.getsizeof(self.root)
            + sys.getsizeof(_EMPTY_KEY)
            + sys.getsizeof([])
            + sys.getsizeof({})
            + sys.getsizeof(b"\0" * self.page_size * TOKEN_DTYPE.itemsize)  # the child-dict key
        )
        per_page = sys.getsizeof(b"\0" * HASH_BYTES) + 8  # the hash object and its list slot
        total = sys.getsizeof(self._index) + sys.getsizeof(self)
        total += (self._n_nodes + 1) * per_node + len(self._index) * per_page
        total += len(self._index) * self.page_size * TOKEN_DTYPE.itemsize
        return total

    # --- mutations --------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int] | np.ndarray, pages: Sequence[PageHash]) -> int:
        """Index the full pages of `tokens`; return how many tokens were already present.

        `pages[i]` is the hash of page i of `tokens`. Hashes are content addresses, so an indexed
        page at the same position always has the same hash; a different one means the caller
        mixed namespaces and is refused, as is a new hash already indexed elsewhere.
        """
        toks = as_tokens(tokens)
        ps = self.page_size
        n_full = len(toks) // ps
        if len(pages) != n_full:
            raise InvalidInput(f"{len(pages)} page hashes for {n_full} full pages of {ps} tokens")
        end = n_full * ps
        now = time.monotonic()

        # Walk without mutating, so a refused insert leaves the tree as it was.
        node = self.root
        pos = 0
        split: tuple[Node, int] | None = None
        while pos < end:
            child = node.children.get(toks[pos : pos + ps].tobytes())
            if child is None:
                break
            matched = self._edge_match(child.key, toks, pos, end)
            first, n = pos // ps, matched // ps
            if child.pages[:n] != list(pages[first : first + n]):
                raise InvalidInput("page hash differs from the indexed one at the same position")
            child.last_access = now
            pos += matched
            if matched < len(child.key):
                if pos < end:
                    split = (child, n)
                break
            node = child
        if pos == end:
            return end

        new_pages = list(pages[pos // ps :])
        if len(set(new_pages)) != len(new_pages) or any(h in self._index for h in new_pages):
            raise InvalidInput("a new page hash is already indexed (or repeated)")

        if split is not None:
            node = self._split(*split)
        new_key = toks[pos:end].copy()
        if node is not self.root and not node.children:
            # Extending a leaf keeps a multi-turn session one node deep instead of one per turn.
            node.key = np.concatenate((node.key, new_key))
            node.pages.extend(new_pages)
            leaf = node
        else:
            leaf = Node(key=new_key, pages=new_pages, parent=node, last_access=now)
            node.children[new_key[:ps].tobytes()] = leaf
            self._n_nodes += 1
        leaf.last_access = now
        index = self._index
        for h in new_pages:
            index[h] = leaf
        return pos

    def remove_from(self, page: PageHash) -> list[PageHash]:
        """Drop `page`, the pages after it and every descendant; return the dropped hashes.

        Raises `NotFoundError` if `page` is not indexed.
        """
        node = self._index.get(page)
        if node is None:
            raise NotFoundError("page is not in the trie")
        i = node.pages.index(page)
        removed = node.pages[i:]
        subtree = list(self._nodes(node))[1:]
        for d in subtree:
            removed.extend(d.pages)
        index = self._index
        for h in removed:
            del index[h]
        for d in subtree:
            self._detach(d)
        self._n_nodes -= len(subtree)

        if i > 0:
            node.key = node.key[: i * self.page_size].copy()
            node.pages = node.pages[:i]
            node.children = {}
            return removed
        parent = node.parent
        if parent is None:
            raise AssertionError("an indexed page is held by a detached node")
        del parent.children[node.key[: self.page_size].tobytes()]
        self._detach(node)
        self._n_nodes -= 1
        if parent is not self.root and len(parent.children) == 1:
            self._merge_only_child(parent)
        return removed

    # --- invariants ---------------------------------------------------------------------------
    def check(self) -> None:
        """Verify every structural invariant; raise AssertionError describing the first broken one."""
        ps = self.page_size
        root = self.root
        if root.parent is not None or len(root.key) or root.pages:
            raise AssertionError("root must have no parent, key or pages")
        seen: dict[PageHash, Node] = {}
        n_nodes = 0
        for node in self._nodes():
            for k, child in node.children.items():
                if child.parent is not node:
                    raise AssertionError("child's parent pointer does not point at its parent")
                if k != child.key[:ps].tobytes():
                    raise AssertionError("child dict key is not the child's first page")
            if node is root:
                continue
            if len(node.children) == 1:
                raise AssertionError("non-root node with a single child (should have been merged)")
            n_nodes += 1
            if node.key.dtype != TOKEN_DTYPE or node.key.ndim != 1:
                raise AssertionError(f"node key has dtype {node.key.dtype}, not int32")
            if not node.pages:
                raise AssertionError("non-root node without pages")
            if len(node.key) != len(node.pages) * ps:
                raise AssertionError(f"key of {len(node.key)} tokens for {len(node.pages)} pages")
            for h in node.pages:
                if h in seen:
                    raise AssertionError("a page hash appears twice in the tree")
                seen[h] = node
        if n_nodes != self._n_nodes:
            raise AssertionError(f"node count {self._n_nodes} but {n_nodes} nodes in the tree")
        if len(seen) != len(self._index):
            raise AssertionError(f"hash index has {len(self._index)} pages, tree has {len(seen)}")
        for h, node in seen.items():
            if self._index.get(h) is not node:
                raise AssertionError("hash index points at the wrong node")
        if len(self) != len(seen) * ps:
            raise AssertionError("token count does not match the pages")

    # --- internals ------------------------------------------------------------------------------
    def _edge_match(self, key: np.ndarray, toks: np.ndarray, pos: int, end: int) -> int:
        """Tokens of `key` that match `toks[pos:end]`, floored to whole pages.

        The caller found the child by its first page, so at least one page matches.
        """
        m = min(len(key), end - pos)
        diff = np.flatnonzero(key[:m] != toks[pos : pos + m])
        if not len(diff):
            return m
        first = int(diff[0])
        return first - first % self.page_size

    def _split(self, node: Node, n_pages: int) -> Node:
        """Cut `node` after `n_pages` pages; return the new node holding the first part.

        `node` keeps the second part, so only the head's pages are re-indexed and `node`'s children
        keep their parent. The head takes `node`'s place under the same child-dict key.
        """
        cut = n_pages * self.page_size
        parent = node.parent
        if parent is None:
            raise AssertionError("cannot split the root")
        head = Node(
            key=node.key[:cut].copy(),
            pages=node.pages[:n_pages],
            parent=parent,
            last_access=node.last_access,
            hit_count=node.hit_count,
        )
        node.key = node.key[cut:].copy()
        node.pages = node.pages[n_pages:]
        node.parent = head
        head.children[node.key[: self.page_size].tobytes()] = node
        parent.children[head.key[: self.page_size].tobytes()] = head
        index = self._index
        for h in head.pages:
            index[h] = head
        self._n_nodes += 1
        return head

    def _merge_only_child(self, node: Node) -> None:
        """Fold `node`'s only child into it.

        The rule: the parent-side object (`node`) always survives. It keeps its place under its
        parent's child-dict key (the merged key starts with the same page), takes the child's
        pages and children, and only the child's pages are re-indexed. Access stats keep the
        larger of the two.
        """
        (child,) = node.children.values()
        node.key = np.concatenate((node.key, child.key))
        node.pages.extend(child.pages)
        node.children = child.children
        for grandchild in node.children.values():
            grandchild.parent = node
        node.last_access = max(child.last_access, node.last_access)
        node.hit_count = max(child.hit_count, node.hit_count)
        index = self._index
        for h in child.pages:
            index[h] = node
        self._detach(child)
        self._n_nodes -= 1

    @staticmethod
    def _detach(node: Node) -> None:
        # Break the parent/child reference cycle so dropped nodes go by reference counting, not by
        # waiting for the cycle collector.
        node.parent = None
        node.children = {}

    def _nodes(self, start: Node | None = None) -> Iterator[Node]:
        """Nodes of the subtree at `start` (default: the root), parents before children."""
        stack = [self.root if start is None else start]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
