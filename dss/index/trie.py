"""The token radix trie: one index per namespace from token prefixes to the page hashes that hold their KV.

The trie is page-granular: every edge key is a whole number of pages (`page_size` tokens each) and
only full pages are indexed. A node's children are keyed by the bytes of their first page, so a
descent is one dict lookup plus one vectorised comparison per node; the number of Python-level
steps depends on the number of nodes on the path, never on the number of tokens.

Locks are reference counts on a node and all its ancestors (a holder of a deep node protects the
whole prefix). Node identity is what holders keep, so restructuring never moves a holder's pages to
another node object: a split keeps the original object as the deeper half, and a merge keeps the
object that may have holders.

The trie is not thread-safe; the page store calls it under its own lock.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from dss.errors import CapacityError, InvalidInput, NotFoundError
from dss.index.hashing import HASH_BYTES, TOKEN_DTYPE, as_tokens
from dss.types import PageHash

_EMPTY_KEY = np.empty(0, dtype=TOKEN_DTYPE)


@dataclass(slots=True, eq=False)
class Node:
    """One edge of the radix tree: `key` tokens whose pages are `pages`, in order."""

    key: np.ndarray
    pages: list[PageHash]
    parent: Node | None
    children: dict[bytes, Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: float = 0.0
    hit_count: int = 0

    @property
    def n_pages(self) -> int:
        return len(self.pages)


@dataclass(frozen=True, slots=True)
class TrieMatch:
    """The longest indexed prefix of a query, in whole pages.

    `node` is the node holding the last matched page (the root when nothing matched); lock it to
    protect every matched page. It may also cover a few unmatched pages after the match, which a
    lock then protects too.
    """

    n_tokens: int
    pages: tuple[PageHash, ...]
    node: Node

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

    def is_locked(self, page: PageHash) -> bool:
        """Whether some holder protects `page` (locks are per node, so whole nodes are protected)."""
        node = self._index.get(page)
        if node is None:
            raise NotFoundError("page is not in the trie")
        return node.lock_ref > 0

    def match(self, tokens: Sequence[int] | np.ndarray, touch: bool = True) -> TrieMatch:
        """Longest indexed prefix of `tokens` made of whole pages; never restructures the tree."""
        toks = as_tokens(tokens)
        ps = self.page_size
        end = len(toks) - len(toks) % ps
        now = time.monotonic() if touch else 0.0
        node = self.root
        deepest = self.root
        pos = 0
        pages: list[PageHash] = []
        while pos < end:
            child = node.children.get(toks[pos : pos + ps].tobytes())
            if child is None:
                break
            matched = self._edge_match(child.key, toks, pos, end)
            n = matched // ps
            pages.extend(child.pages if n == len(child.pages) else child.pages[:n])
            deepest = child
            if touch:
                child.last_access = now
                child.hit_count += 1
            pos += matched
            if matched < len(child.key):
                break
            node = child
        return TrieMatch(n_tokens=pos, pages=tuple(pages), node=deepest)

    def pages_on_path(self, tokens: Sequence[int] | np.ndarray) -> list[PageHash]:
        """Hashes of the indexed pages of the longest prefix of `tokens`, without touching stats."""
        return list(self.match(tokens, touch=False).pages)

    def iter_pages(self) -> Iterator[PageHash]:
        """Every indexed page, parents before children."""
        for node in self._nodes():
            yield from node.pages

    def evictable_leaves(self) -> Iterator[PageHash]:
        """The last page of every unlocked leaf: what can go first without orphaning anything.

        A snapshot, so the caller may remove pages while iterating.
        """
        out = [n.pages[-1] for n in self._nodes() if n.pages and not n.children and n.lock_ref == 0]
        return iter(out)

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
            # A holder of the leaf then protects the new pages too, which only errs on the safe side.
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

    def lock(self, node: Node) -> None:
        """Protect `node`'s pages and all its ancestors' from removal."""
        self._require_attached(node)
        n: Node | None = node
        while n is not None:
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: Node) -> None:
        self._require_attached(node)
        # Ancestors' counts are at least the node's, so checking the node covers the whole path.
        if node.lock_ref <= 0:
            raise InvalidInput("unlock without a matching lock")
        n: Node | None = node
        while n is not None:
            n.lock_ref -= 1
            n = n.parent

    def remove_from(self, page: PageHash) -> list[PageHash]:
        """Drop `page`, the pages after it and every descendant; return the dropped hashes.

        Refused with `CapacityError` if any of them is locked.
        """
        node = self._index.get(page)
        if node is None:
            raise NotFoundError("page is not in the trie")
        # Descendants' lock counts never exceed the node's, so one test covers the subtree.
        if node.lock_ref > 0:
            raise CapacityError("cannot remove locked pages")
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
            # A lock counts on the locked node and every ancestor, so a node holds at least the
            # sum of its children's counts (the rest are holders of the node itself).
            if node.lock_ref < sum(c.lock_ref for c in node.children.values()):
                raise AssertionError("a node holds fewer locks than its children together")
            if node.lock_ref < 0:
                raise AssertionError("negative lock count")
            if node is root:
                continue
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

        `node` keeps the second part so holders of its lock keep protecting the same pages, and the
        new prefix node inherits its lock count as their ancestor.
        """
        cut = n_pages * self.page_size
        parent = node.parent
        if parent is None:
            raise AssertionError("cannot split the root")
        head = Node(
            key=node.key[:cut].copy(),
            pages=node.pages[:n_pages],
            parent=parent,
            lock_ref=node.lock_ref,
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
        """Fold a single-child chain into one node, keeping the object that holders may reference.

        Holders directly on `node` number `node.lock_ref - child.lock_ref`. With none, the child
        absorbs `node`; if the child's subtree has no holders, `node` absorbs the child; when both
        have holders the chain stays (still valid, just one extra node on the path).
        """
        (child,) = node.children.values()
        parent = node.parent
        if parent is None:
            raise AssertionError("cannot merge the root")
        if node.lock_ref == child.lock_ref:
            child.key = np.concatenate((node.key, child.key))
            child.pages = node.pages + child.pages
            child.parent = parent
            child.last_access = max(child.last_access, node.last_access)
            child.hit_count = max(child.hit_count, node.hit_count)
            parent.children[child.key[: self.page_size].tobytes()] = child
            moved, keep, gone = node.pages, child, node
        elif child.lock_ref == 0:
            node.key = np.concatenate((node.key, child.key))
            node.pages = node.pages + child.pages
            node.children = child.children
            for grandchild in node.children.values():
                grandchild.parent = node
            node.last_access = max(child.last_access, node.last_access)
            node.hit_count = max(child.hit_count, node.hit_count)
            moved, keep, gone = child.pages, node, child
        else:
            return
        index = self._index
        for h in moved:
            index[h] = keep
        gone.children = {}
        self._detach(gone)
        self._n_nodes -= 1

    @staticmethod
    def _detach(node: Node) -> None:
        # parent=None marks the node as gone (lock() refuses it) and breaks the reference cycle.
        node.parent = None
        node.children = {}
        node.lock_ref = 0

    def _require_attached(self, node: Node) -> None:
        if node.parent is None and node is not self.root:
            raise InvalidInput("node is no longer in the trie (lock a match before mutating the trie)")

    def _nodes(self, start: Node | None = None) -> Iterator[Node]:
        """Nodes of the subtree at `start` (default: the root), parents before children."""
        stack = [self.root if start is None else start]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
