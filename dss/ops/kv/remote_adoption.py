"""Adopting pages of the fleet's remote tier into a local match: reading the query's next pages
from Redis (`remote_pages_after`: the values themselves, batched and pipelined; a missing value
is the miss, there is no existence round trip first), entering them into the page table and the
index (`index_adopted`), then copying the pages read into host slots. No lock here: `KVCache`
gates the insertion like a save of the tenant."""

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
from dss.pages.tiers.remote import FetchedPage
from dss.types import FingerprintId, Namespace, PageHash


@dataclass(frozen=True, slots=True)
class RemoteFind:
    """Pages the remote tier holds after a local match: `new` (whole pages, then possibly a tail
    page) follow the match's `start` pages and cover the query up to `n_tokens`; `fetched`:
    each one as read (promoted into host slots by `promote_adopted`)."""

    new: list[PageHash]
    start: int
    n_tokens: int
    fetched: list[FetchedPage]
    gone: list[PageHash]  # pages evicted from the host tier to make room for the reads


def remote_pages_after(
    pages: TieredPages, fp: ModelFingerprint, own_ns: Namespace, tokens: np.ndarray, m: IndexMatch
) -> RemoteFind | None:
    """Read the query's next whole pages (chained hashes, up to the first one Redis lacks), then
    its candidate tail pages, in batched pipelined round trips (`Promoter.fetch_remote`). None
    when Redis has none of them or does not answer."""
    bs = fp.block_size
    start = len(m.pages)
    n_whole = len(tokens) // bs
    if start * bs >= len(tokens):
        return None
    parent = m.pages[-1] if start else ROOT_PARENT
    try:
        wanted = chain_hashes(own_ns.id, tokens[: n_whole * bs], bs, parent=parent, start_page=start)
        gone: list[PageHash] = []
        got = pages.promoter.fetch_remote(wanted, own_ns.tenant, fp.page_nbytes, gone=gone)
        fetched = [f for f in got if f is not None]
        found = len(fetched)
        new = wanted[:found]
        end = (start + found) * bs
        tail_parent = new[-1] if new else parent
        rest = tokens[end : end + bs - 1]
        # Only tails longer than the one the match holds here already: after a prefetch, a turn's
        # prompt ends in the previous turn's tail page, which is in the host tier (asking for it
        # again read its 3 MB from Redis a second time on every cross-server turn).
        held = 0 if new else m.partial_tokens
        tail_k = 0
        if len(rest) > held:
            lengths = range(held + 1, len(rest) + 1)
            candidates = [tail_hash(own_ns.id, tail_parent, rest[:k]) for k in lengths]
            # Tail candidates are mostly absent: the values of those Redis holds come back in the
            # same round trip as the nils of the others.
            got = pages.promoter.fetch_remote(
                candidates, own_ns.tenant, fp.page_nbytes, stop_at_miss=False, one_round_trip=True, gone=gone
            )
            longest = max((i for i, f in enumerate(got) if f is not None), default=None)
            if longest is not None:
                tail_k = lengths[longest]
                new.append(candidates[longest])
                tail = got[longest]
                assert tail is not None
                fetched.append(tail)
            pages.promoter.discard_fetched([f for i, f in enumerate(got) if i != longest])
    except TierUnavailable:
        return None
    if not new:
        return None
    return RemoteFind(new, start, end + tail_k, fetched, gone)


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


def promote_adopted(pages: TieredPages, find: RemoteFind) -> list[PageHash]:
    """Copy the pages read into host slots (a page not promoted stays remote-only, read again by
    the load's promotion); returns the pages that left the table meanwhile."""
    gone = list(find.gone)
    for f in find.fetched:
        pages.promoter.promote_fetched(f, gone)
    return gone
