"""Chained content addresses of pages.

A page's hash covers its namespace, its parent page's hash and its own token ids, so equal
hashes mean "same tokens after the same prefix in the same namespace". blake2b is stable across
processes and restarts (unlike Python's `hash`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from dss.tokens import as_tokens
from dss.types import HASH_BYTES, NamespaceId, PageHash

ROOT_PARENT = PageHash(b"\x00" * HASH_BYTES)


def page_hash(namespace: NamespaceId, parent: PageHash, page_tokens: np.ndarray) -> PageHash:
    return _digest(namespace, parent, as_tokens(page_tokens).tobytes())


def _digest(namespace: bytes, parent: bytes, token_bytes: bytes) -> PageHash:
    """The one definition of a page's address: its namespace, its parent's hash, its tokens."""
    return PageHash(hashlib.blake2b(namespace + parent + token_bytes, digest_size=HASH_BYTES).digest())


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
    # Bytes-level: one conversion, then one digest per page of a slice of it; asked on every
    # load and save plan, for every page of the prompt.
    raw = arr.tobytes()
    step = block_size * arr.itemsize
    out: list[PageHash] = []
    prev = parent
    for i in range(start_page, n_pages):
        ns = namespaces[i - start_page] if namespaces is not None else namespace
        prev = _digest(ns, prev, raw[i * step : (i + 1) * step])
        out.append(prev)
    return out
