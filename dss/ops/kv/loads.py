"""`KVLoads`: an engine's loads. `begin_load` matches and pins the pages (a `Lease`) and has
loader threads promote the pages not in the host arena; `wait_loaded` hands out their host
slots and validates the engine's copies; `release` unpins them once every engine rank copied.

Pages read from the fleet's shared tier go into the host tier only: Redis holds them, so they are
not written to this server's disk as well (that write, compressing and syncing every page a
cross-server turn reads, ran on the same cores at the moment the engine loaded them: ~0.1 s of a
turn's 0.35 s on 2 cores). Evicted from the host tier, such a page is dropped, and read from
Redis again when needed.

A page that no rank may trust comes back None: one not promoted in time, or one erased (its slot
reused) between the pin and the copy. A lease whose engine never came back is released by
`expire_stale`, so its pages can be evicted again.

Lock: `KVLoads._lock` is a leaf around the leases. The index, the page table and the tiers are
called with no lock held; the remote tier's pages are adopted inside `TenantGate.saving`, like a
save of the tenant.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from dss.errors import DSSError, InvalidInput
from dss.index.fingerprints import FingerprintRegistry
from dss.index.prefix_index import IndexMatch, PrefixIndex
from dss.namespace import make_namespace
from dss.ops.kv.in_flight import Lease
from dss.ops.kv.lookup import KVLookup
from dss.ops.kv.matching import match_info, with_partial
from dss.ops.kv.remote_adoption import index_adopted, promote_adopted, remote_pages_after
from dss.ops.kv.tenant_gate import TenantGate
from dss.pages.placement import TieredPages
from dss.types import FingerprintId, PageHash, TenantId, Tier
from dss.wire import LoadPlan, PageSlot, SlotRef

# A plan names each page's tier by its plain value: read once, not per page of every load.
_TIER_NAMES = tuple(t.value for t in Tier)
_HOST, _DISK, _REMOTE = Tier.HOST.value, Tier.DISK.value, Tier.REMOTE.value

log = logging.getLogger("dss.kv")

_PREFETCH_WAIT_S = 5.0  # how long a load waits for a prefetch of its tenant in flight
_ARRIVED_S = 300.0
_ARRIVED_MAX = 65536


class KVLoads:
    def __init__(
        self,
        fingerprints: FingerprintRegistry,
        index: PrefixIndex,
        pages: TieredPages,
        lookup: KVLookup,
        gate: TenantGate,
        loader_threads: int,
    ) -> None:
        self._fingerprints = fingerprints
        self._index = index
        self._pages = pages
        self._lookup = lookup
        self._gate = gate
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._loader = ThreadPoolExecutor(max_workers=loader_threads, thread_name_prefix="dss-loader")
        # Prefetches from the remote tier (`prefetch`): one per (model, tenant) at a time, their
        # pages' bytes in flight bounded by `RemoteConfig.prefetch_max_bytes`.
        self._prefetcher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="dss-prefetch")
        self._prefetching: dict[tuple[FingerprintId, TenantId], tuple[Future[int], int]] = {}
        # Pages just read from the remote tier into the host tier (adopted by a load or a
        # prefetch), until a load reports them: it says they came from Redis, not from this
        # server's memory. Bounded: older than `_ARRIVED_S` or past `_ARRIVED_MAX` are forgotten.
        self._arrived: dict[PageHash, float] = {}

    def close(self) -> None:
        self._prefetcher.shutdown(wait=True, cancel_futures=True)
        self._loader.shutdown(wait=True, cancel_futures=True)

    # --------------------------------------------------------------------------------- prefetch
    def prefetch(self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray) -> bool:
        """Start reading the pages of `tokens` the remote tier holds (and this server does not)
        into the host tier, off the caller's thread: called as soon as a turn's target is
        resolved, so that the engine's `begin_load` finds them here. Never blocks and never
        raises; False when not started (no remote tier, a prefetch of this tenant and model in
        flight, over the byte budget, or closing). A `begin_load` of the same tenant and model
        waits for it (`pin`), so the pages are read once."""
        remote = self._pages.remote
        if remote is None or fid not in self._fingerprints or not remote.available:
            return False
        fp = self._fingerprints.get(fid)
        cost = (len(tokens) // fp.block_size + 1) * fp.page_nbytes
        key = (fid, tenant)
        with self._lock:
            in_flight = sum(c for _f, c in self._prefetching.values())
            if key in self._prefetching or in_flight + cost > remote.config.prefetch_max_bytes:
                self._pages.counters.count("prefetch_skipped")
                return False
            try:
                fut = self._prefetcher.submit(self._prefetch, fid, tenant, self._lookup.tokens(tokens))
            except (RuntimeError, DSSError):  # closing, or too many tokens
                return False
            self._prefetching[key] = (fut, cost)
        fut.add_done_callback(lambda _f: self._prefetch_done(key))
        self._pages.counters.count("prefetch_started")
        return True

    def _prefetch_done(self, key: tuple[FingerprintId, TenantId]) -> None:
        with self._lock:
            self._prefetching.pop(key, None)

    def _prefetch(self, fid: FingerprintId, tenant: TenantId, tokens: np.ndarray) -> int:
        try:
            m = self._index.match(fid, tenant, tokens, touch=False)
            n = self._adopt_remote(fid, tenant, tokens, m)
            self._pages.counters.count("prefetch_pages", n=n)
            return n
        except Exception:  # a prefetch is only a head start: the load reads what it lacks
            log.exception("prefetch from the remote tier failed")
            return 0

    def cancel_prefetches(self) -> int:
        """Cancel the prefetches not started yet; returns how many."""
        with self._lock:
            futures = [f for f, _c in self._prefetching.values()]
        return sum(1 for f in futures if f.cancel())

    def _await_prefetch(self, fid: FingerprintId, tenant: TenantId) -> None:
        """Wait for a prefetch of this tenant and model in flight (its pages are then local)."""
        with self._lock:
            got = self._prefetching.get((fid, tenant))
        if got is not None and self._pages.remote is not None:
            with contextlib.suppress(FutureTimeout, CancelledError):
                got[0].result(timeout=_PREFETCH_WAIT_S)

    def pin(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        start_token: int = 0,
        max_tokens: int | None = None,
    ) -> LoadPlan | None:
        """Match and pin the pages after `start_token` (a multiple of the block size) among the
        first `max_tokens` of `tokens` (all of them when None); the plan's `stored_tokens` also
        says how far the store holds the rest. Pages only on disk are promoted into the host
        arena by loader threads (the plan is then async)."""
        bs = self._fingerprints.get(fid).block_size
        if start_token % bs:
            raise InvalidInput(f"start_token {start_token} is not a multiple of the block size {bs}")
        arr = self._lookup.tokens(tokens)
        query = arr if max_tokens is None else arr[: max(0, max_tokens)]
        self._await_prefetch(fid, tenant)
        m = self._index.match(fid, tenant, query)
        if self._pages.remote is not None and self._adopt_remote(fid, tenant, query, m):
            m = self._index.match(fid, tenant, query)
        pages = with_partial(m)
        first = start_token // bs
        if len(pages) <= first:
            return None
        held = self._pages.lease_prefix(pages)
        if len(held) <= first:
            self._pages.unlease(held)
            return None
        sizes = match_info(m, len(held), bs).page_tokens(bs)
        if not worth_loading(sum(sizes[first:]), start_token, len(arr), bs):
            self._pages.unlease(held)
            return None
        futures: dict[int, Future[SlotRef | None]] = {}
        tier_tokens = dict.fromkeys(_TIER_NAMES, 0)
        plan_pages: list[PageSlot] = []
        arrived = self._take_arrived(h.hash for h in held[first:])
        for i in range(first, len(held)):
            page, ref = held[i].hash, held[i].host_ref
            tier = _REMOTE if page in arrived else _HOST
            if ref is None:
                tier = _REMOTE if self._pages.tiers_of(page) == {Tier.REMOTE} else _DISK
                futures[i] = self._loader.submit(self._promote, page)
            tier_tokens[tier] += sizes[i]
            plan_pages.append(PageSlot(i, page, ref, tier))
        load_id = uuid.uuid4().hex
        shards = self._fingerprints.get(fid).shards
        with self._lock:
            self._leases[load_id] = Lease(held, tuple(plan_pages), futures, shards)
        n_tokens = sum(sizes[first:])
        stored = start_token + n_tokens
        if len(held) == len(pages) and stored == len(query) < len(arr):
            stored = self._stored_beyond(fid, tenant, arr, stored, bs)
        return LoadPlan(load_id, n_tokens, start_token, tuple(plan_pages), bool(futures), tier_tokens, stored)

    def _stored_beyond(
        self, fid: FingerprintId, tenant: TenantId, tokens: np.ndarray, loaded: int, block_size: int
    ) -> int:
        """How far the tenant's own pages hold `tokens`, for a load that reached its `max_tokens`
        (at least `loaded`): the engine then need not ask to save what the store holds (a turn
        whose answer is one token computes nothing past its prompt). A match that starts with
        public pages counts only what is loaded: saving it links those pages into the tenant's
        own trie."""
        full = self._index.match(fid, tenant, tokens, touch=False)
        if full.public_pages:
            return loaded
        return max(loaded, full.n_tokens(block_size))

    def _promote(self, page: PageHash) -> SlotRef | None:
        gone: list[PageHash] = []
        try:
            return self._pages.promoter.promote_to_host(page, gone)
        finally:
            self._lookup.forget(gone)

    def _adopt_remote(self, fid: FingerprintId, tenant: TenantId, tokens: np.ndarray, m: IndexMatch) -> int:
        """Extend a local match with the pages the remote tier holds (`remote_pages_after`: read,
        not only looked up). Pages found enter the page table and the index, and those read go
        into host slots. Returns how many pages were adopted (0: none found). Redis unavailable:
        nothing found, nothing raised."""
        remote = self._pages.remote  # an unavailable one fails fast (and is tried again later)
        if remote is None or self._gate.is_retired(tenant):
            return 0
        fp = self._fingerprints.get(fid)
        own_ns = make_namespace(fid, tenant)
        find = remote_pages_after(self._pages, fp, own_ns, tokens, m)
        if find is None:
            return 0
        # Counted like a save: an erasure of the tenant that began meanwhile refuses it, and one
        # that begins now waits until these pages are in the table and the index (then drops them).
        with self._gate.saving(tenant) as allowed:
            if not allowed:
                self._pages.promoter.discard_fetched(find.fetched)
                self._lookup.forget(find.gone)
                return 0
            index_adopted(self._pages, self._index, fp, fid, own_ns, tokens, list(m.pages), find)
            gone = promote_adopted(self._pages, find)
        self._note_arrived(find.new)
        self._lookup.forget(gone)
        return len(find.new)

    def _note_arrived(self, pages: Sequence[PageHash]) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._arrived) + len(pages) > _ARRIVED_MAX:
                limit = now - _ARRIVED_S
                self._arrived = {h: t for h, t in self._arrived.items() if t > limit}
                while len(self._arrived) + len(pages) > _ARRIVED_MAX:
                    del self._arrived[next(iter(self._arrived))]  # the oldest first
            for h in pages:
                self._arrived[h] = now

    def _take_arrived(self, pages: Iterable[PageHash]) -> set[PageHash]:
        """Which of `pages` were read from the remote tier for a load still to report them
        (each is reported once)."""
        limit = time.monotonic() - _ARRIVED_S
        out: set[PageHash] = set()
        with self._lock:
            if not self._arrived:  # the common case: nothing read from the remote tier lately
                return out
            for h in pages:
                t = self._arrived.pop(h, None)
                if t is not None and t > limit:
                    out.add(h)
        return out

    def wait_loaded(
        self, load_id: str, timeout_s: float = 30.0, release: bool = False, shard: int | None = None
    ) -> tuple[PageSlot | None, ...]:
        """Every page of the plan with its host slot, or None where the page cannot be had (not
        promoted in time, or erased since it was pinned). `release=True` also ends the lease
        (`shard`: the engine rank releasing, see `release`): a copy taken before then that raced
        an erasure comes back None, never trusted; an engine asks this as a count
        (`release_checked`)."""
        with self._lock:
            lease = self._leases.get(load_id)
        if lease is None:
            return ()
        refs, ok = self._checked(lease, time.monotonic() + timeout_s)
        if release:
            self.release(load_id, shard)
        return tuple(
            PageSlot(ps.page_index, ps.hash, ref) if good else None
            for ps, ref, good in zip(lease.plan_pages, refs, ok, strict=True)
        )

    def release_checked(self, load_id: str, shard: int | None = None) -> int:
        """`wait_loaded(load_id, 0.0, release=True, shard=shard)` as a count: how many of the
        plan's pages, from the first, a copy taken before this call can be trusted for (0 for a
        lease that is gone). Asked after an async load's copy (a hot turn's pages are checked
        by their slots' generations in the engine instead): the pages are checked under one lock,
        and no page objects are built."""
        with self._lock:
            lease = self._leases.get(load_id)
        if lease is None:
            return 0
        _, ok = self._checked(lease, time.monotonic())
        self.release(load_id, shard)
        return next((i for i, good in enumerate(ok) if not good), len(ok))

    def _checked(self, lease: Lease, deadline: float) -> tuple[list[SlotRef | None], list[bool]]:
        """Each plan page's host slot (the one planned, or the one its promotion ends in, waited
        for until `deadline`; None when not promoted by then), and whether a copy from it is of
        the page leased: every page under one lock of the page table."""
        refs: list[SlotRef | None] = []
        for ps in lease.plan_pages:
            fut = lease.futures.get(ps.page_index)
            if fut is None:
                refs.append(ps.slot)
                continue
            try:
                refs.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                refs.append(None)
        leased = (lease.held[ps.page_index] for ps in lease.plan_pages)
        return refs, self._pages.table.valid_each(zip(leased, refs, strict=True))

    def release(self, load_id: str, shard: int | None = None) -> None:
        """End a load's lease. Each rank of a parallel engine releases its own `shard` after its
        copy; the pages stay pinned until every rank did. None releases it whole (the scheduler
        dropping a plan no worker received)."""
        with self._lock:
            lease = self._leases.get(load_id)
            if lease is None:
                return
            if shard is not None:
                if not 0 <= shard < lease.shards:
                    raise InvalidInput(f"shard {shard} of a load by {lease.shards} engine ranks")
                lease.released.add(shard)
                if len(lease.released) < lease.shards:
                    return
            del self._leases[load_id]
        self._pages.unlease(lease.held)

    def expire_stale(self, timeout_s: float) -> None:
        """Release the leases older than `timeout_s` (their engine died mid-load): otherwise
        their pages could never be evicted."""
        limit = time.monotonic() - timeout_s
        with self._lock:
            stale = [k for k, v in self._leases.items() if v.created < limit]
        for k in stale:
            log.warning("releasing load %s: not released within %ss", k, timeout_s)
            self.release(k)

    def count(self) -> int:
        with self._lock:
            return len(self._leases)


# At most what every chat of a user shares: the chat template's opening (4-8 tokens for the
# default model's, ~30 for Llama 3's with its date lines).
OPENING_TOKENS = 32


def worth_loading(n_tokens: int, start_token: int, n_sequence: int, block_size: int) -> bool:
    """Whether a load of `n_tokens` from `start_token` is worth making: not when it is a few
    tokens (`OPENING_TOKENS`) of one page at the very start of a sequence that is mostly new,
    which is another chat's tail page matching the chat template's opening. Such a load saves
    computing those few tokens and cost cold prompts under concurrent load far more: skipping it
    took DSS's mean time to first token from 1.31x to 1.05x the same engine without the connector
    (bench/cold_concurrent.py; docs/operations.md, "Cold turns under concurrent load"; why a few
    loaded tokens cost that much is not established). A short history that is most of its
    sequence still loads, and so does any tail after whole pages."""
    few = n_tokens < min(block_size, OPENING_TOKENS)
    return start_token > 0 or not few or 2 * n_tokens >= n_sequence
