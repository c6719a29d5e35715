"""Chained content addresses of pages.

A page's hash covers its namespace, its parent page's hash and its own token ids, so equal
hashes mean "same tokens after the same prefix in the same namespace". blake2b is stable across
processes and restarts (unlike Python's `hash`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from dss.types import TOKEN_DTYPE, NamespaceId, PageHash

HASH_BYTES = 32
ROOT_PARENT = PageHash(b"\x00" * HASH_BYTES)


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array (no copy when already one)."""
    arr = np.asarray(tokens, dtype=TOKEN_DTYPE)
    if arr.ndim != 1:
        raise ValueError("token ids must be a 1-D sequence")
    return np.ascontiguousarray(arr)


def page_hash(namespace: NamespaceId, parent: PageHash, page_tokens: np.ndarray) -> PageHash:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(namespace)
    h.update(parent)
    h.update(as_tokens(page_tokens).tobytes())
    return PageHash(h.digest())


def chain_hashes(
    namespace: NamespaceId,
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    parent: PageHash = ROOT_PARENT,
    start_page: int = 0,
    namespaces: Sequence[NamespaceId] | None = None,
) -> list[PageHash]:
    """Hashes of the full pages of `tokens` from page `start_page` on, chained from `parent`.

    `namespaces`, when given, names the namespace of each page from `start_page` on (used when a
    public prefix is followed by private pages); otherwise every page is in `namespace`.
    """
    arr = as_tokens(tokens)
    n_pages = len(arr) // block_size
    out: list[PageHash] = []
    prev = parent
    for i in range(start_page, n_pages):
        ns = namespaces[i - start_page] if namespaces is not None else namespace
        prev = page_hash(ns, prev, arr[i * block_size : (i + 1) * block_size])
        out.append(prev)
    return out
