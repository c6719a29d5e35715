"""Adopting pages of the fleet's remote tier into a local match: which of the query's next pages
Redis holds (`remote_pages_after`), and entering them into the page table and the index
(`index_adopted`). No lock here: `KVCache` gates the insertion like a save of the tenant."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dss.errors import TierUnavailable
from dss.index.hashing import ROOT_PARENT, chain_hashes
from dss.index.prefix_index import IndexMatch, PrefixIndex
from dss.index.tails import tail_hash
from dss.namespace import ModelFingerprint
from dss.pages.meta import PageMeta
from dss.pages.placement import TieredPages
from dss.pages.tiers.remote import RemoteTier
from dss.types import FingerprintId, Namespace, PageHash


@dataclass(frozen=True, slots=True)
class RemoteFind:
    """Pages the remote tier holds after a local match: `new` (whole pages, then possibly a tail
    page) follow the match's `start` pages and cover the query up to `n_tokens`."""

    new: list[PageHash]
    start: int
    n_tokens: int


def remote_pages_after(
    remote: RemoteTier, fp: ModelFingerprint, own_ns: Namespace, tokens: np.ndarray, m: IndexMatch
) -> RemoteFind | None:
    """The chained hashes of the query's next whole pages, then its candidate tail pages, each
    asked in one pipelined round trip. None when Redis has none of them or does not answer."""
    bs = fp.block_size
    start = len(m.pages)
    n_whole = len(tokens) // bs
    if start * bs >= len(tokens):
        return None
    parent = m.pages[-1] if start else ROOT_PARENT
    try:
        wanted = chain_hashes(own_ns.id, tokens[: n_whole * bs], bs, parent=parent, start_page=start)
        found = 0
        for ok in remote.exists(wanted):
            if not ok:
                break
            found += 1
        new = wanted[:found]
        end = (start + found) * bs
        tail_parent = new[-1] if new else parent
        rest = tokens[end : end + bs - 1]
        tail_k = 0
        if len(rest):
            candidates = [tail_hash(own_ns.id, tail_parent, rest[:k]) for k in range(1, len(rest) + 1)]
            present = remote.exists(candidates)
            tail_k = max((k + 1 for k, ok in enumerate(present) if ok), default=0)  # the longest
            if tail_k:
                new.append(candidates[tail_k - 1])
    except TierUnavailable:
        return None
    if not new:
        return None
    return RemoteFind(new, start, end + tail_k)


def index_adopted(
    pages: TieredPages,
    index: PrefixIndex,
    fp: ModelFingerprint,
    fid: FingerprintId,
    own_ns: Namespace,
    tokens: np.ndarray,
    matched: list[PageHash],
    find: RemoteFind,
) -> None:
    """The pages found enter the page table (remote-only: a load promotes them) and the index."""
    bs = fp.block_size
    path = matched + find.new
    for i in range(find.start, len(path)):
        lo = i * bs
        hi = min(lo + bs, find.n_tokens)
        meta = PageMeta(
            hash=path[i],
            namespace=own_ns.id,
            tenant=own_ns.tenant,
            fingerprint=fid,
            parent=path[i - 1] if i else ROOT_PARENT,
            index=i,
            nbytes=fp.page_nbytes,
            tokens=tokens[lo:hi].copy(),
        )
        pages.add_remote_resident(meta)
    pushed_out = index.insert(own_ns, bs, tokens[: find.n_tokens], path)
    if pushed_out:
        pages.copies.drop(pushed_out)
