"""The content addresses of a user's own pages, computed from token ids rather than read from the
index: for copies that no index of this server lists (the remote tier, which a server that never
served the session never indexed, or that a restart forgot) and for pages the index holds off a
version's path (the tail of a turn's prompt, which no version ends with).

A page's address is chained from its namespace, its parent and its tokens
(`dss.index.hashing`), so the tokens of a stored version say every address a save of them, or of
a prefix of them, can have used: the whole pages after the public prefix (chained from its last
page) and, for pages saved before that prefix was registered, from the root; and a tail page
(`dss.index.tails`) after any of those pages (or the root) holding the next 1 .. page_size-1
tokens. `saved_addresses` lists them all (a deleted session's versions'); `reached_addresses`
those a load of the tokens reaches (whole pages from the start, then the tail that ends them: a remaining
version's), the same rule `PrefixIndex.path_pages` applies to what the index holds.

Pure functions. Which public prefixes the tokens start with is the caller's (`PublicSplits`):
the registered ones, and those the index holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet

import numpy as np

from dss.index.hashing import ROOT_PARENT, chain_hashes, page_hash
from dss.index.tails import tail_hash
from dss.namespace import public_namespace
from dss.types import Namespace, PageHash

# The numbers of leading public pages a save of the tokens can have found in the index.
PublicSplits = Callable[[np.ndarray], AbstractSet[int]]


def _starts(ns: Namespace, tokens: np.ndarray, bs: int, splits: PublicSplits) -> list[tuple[PageHash, int]]:
    """(parent of the first own page, its page number) for each way a save can have chained the
    own pages: from the root, and after each public prefix `splits` names."""
    ks = sorted(k for k in splits(tokens) if 0 < k <= len(tokens) // bs)
    public = chain_hashes(public_namespace(ns.fingerprint).id, tokens[: ks[-1] * bs], bs) if ks else []
    return [(ROOT_PARENT, 0), *((public[k - 1], k) for k in ks)]


def saved_addresses(
    ns: Namespace, token_lists: Iterable[np.ndarray], bs: int, splits: PublicSplits
) -> set[PageHash]:
    """Every address under which a save of one of `token_lists`, or of a prefix of one, stored a
    page of the namespace: its whole pages, and the tails after each of them (and after their
    parent). About `page_size` addresses per distinct page: the tails after a page that two
    lists share (a session's versions share their history) are computed once."""
    out: set[PageHash] = set()
    for tokens in token_lists:
        for parent, k in _starts(ns, tokens, bs, splits):
            chain = chain_hashes(ns.id, tokens, bs, parent=parent, start_page=k)
            for i, before in enumerate([parent, *chain]):
                if i and before in out:
                    continue  # the tails after this page are in already
                rest = tokens[(k + i) * bs : (k + i + 1) * bs - 1]
                out.update(tail_hash(ns.id, before, rest[:n]) for n in range(1, len(rest) + 1))
            out.update(chain)
    return out


def reached_addresses(
    ns: Namespace, tokens: np.ndarray, bs: int, splits: PublicSplits, among: AbstractSet[PageHash]
) -> set[PageHash]:
    """Of `among`, the addresses a load of `tokens` reaches: its whole pages from the start (the
    first one outside `among` ends the walk: every later address differs too, being chained),
    then the tail that ends `tokens`."""
    out: set[PageHash] = set()
    n_whole = len(tokens) // bs
    for parent, k in _starts(ns, tokens, bs, splits):
        last = parent
        for i in range(k, n_whole):
            h = page_hash(ns.id, last, tokens[i * bs : (i + 1) * bs])
            if h not in among:
                break
            out.add(h)
            last = h
        else:
            rest = tokens[n_whole * bs :]
            if len(rest) and (tail := tail_hash(ns.id, last, rest)) in among:
                out.add(tail)
    return out
