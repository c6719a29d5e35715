"""KV loads and saves: the prefix index and the tiered pages used together, for engines.

The named primitives follow vLLM's offloading connector: `match` (how much is stored),
`begin_load` / `wait_loaded` / `release` (pin pages, promote them into the host arena, validate
the engine's copies, unpin), and `plan_save` / `commit_save` / `abort_save` (reserve host slots
for the pages the store lacks, publish them once the engine copied them).

Lock: `KVCache._lock` is a leaf around the registries of leases, pending saves and tenants being
erased. The index and the page table are called with no lock held; a page one of them drops is
handed to `forget`, which unlinks it from the index afterwards. The order of calls between the
parts, never nested: index → page table → tiers (inside `TieredPages`) → index again (`forget`).

Erasure cooperates through `erasing(tenant)`: while it is held, saves of the tenant are refused
and the saves already in flight have finished, so nothing of the tenant is published behind the
erasure's back.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from dss.config import StoreConfig
from dss.errors import (
    InvalidInput,
    LimitExceeded,
    PageShapeMismatch,
    StorageError,
    StoreClosed,
)
from dss.index.fingerprints import FingerprintRegistry
from dss.index.hashing import ROOT_PARENT, chain_hashes
from dss.index.prefix_index import IndexMatch, PrefixIndex
from dss.index.tails import tail_hash
from dss.namespace import make_namespace, public_namespace
from dss.ops.kv.matching import MatchInfo, match_info, with_partial
from dss.ops.kv.records import Lease, PendingSave
from dss.ops.kv.remote import index_adopted, remote_pages_after
from dss.ops.writeback import DiskWriter
from dss.pages.meta import PageMeta
from dss.pages.tiered import TieredPages
from dss.tokens import as_tokens
from dss.types import PUBLIC_TENANT, FingerprintId, PageHash, TenantId, Tier
from dss.wire import LoadPlan, PageSlot, SavePlan, SlotRef

log = logging.getLogger("dss.kv")

_ERASE_WAIT_S = 30.0


class KVCache:
    def __init__(
        self,
        config: StoreConfig,
        fingerprints: FingerprintRegistry,
        index: PrefixIndex,
        pages: TieredPages,
        is_retired: Callable[[TenantId], bool] = lambda _tenant: False,
    ) -> None:
        self.config = config
        self._is_retired = is_retired  # a tenant erased for good (`Keyring.is_retired`)
        self.fingerprints = fingerprints
        self.index = index
        self.pages = pages
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)  # notified when a tenant's save finishes
        self._leases: dict[str, Lease] = {}
        self._saves: dict[str, PendingSave] = {}
        self._erasing: dict[TenantId, int] = {}  # erasures of each tenant running now
        self._active: dict[TenantId, int] = {}  # saves of each tenant being published now
        self._pins: dict[FingerprintId, list[np.ndarray]] = {}
        self._loader = ThreadPoolExecutor(max_workers=config.loader_threads, thread_name_prefix="dss-loader")
        write_through = config.write_through and (pages.disk is not None or pages.remote is not None)
        self.writer = DiskWriter(pages, self.forget) if write_through else None
        self._closed = False

    def close(self) -> None:
        self._closed = True
        self._loader.shutdown(wait=True, cancel_futures=True)
        if self.writer is not None:
            self.writer.close()

    def ensure_open(self) -> None:
        """`StoreClosed` once `close` ran: what a match, load, save or erasure meets then."""
        if self._closed:
            raise StoreClosed("the store is closed")

    # ------------------------------------------------------------------ matching
    def _tokens(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        arr = as_tokens(tokens)
        if len(arr) > self.config.max_tokens_per_sequence:
            raise LimitExceeded(
                f"{len(arr)} tokens exceed the limit of {self.config.max_tokens_per_sequence}"
            )
        return arr

    def match(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray, touch: bool = True
    ) -> MatchInfo:
        """Longest stored prefix for `tokens` in the tenant's namespace, public prefixes
        included: whole pages, then the page (a tail page, or a whole one) the rest of `tokens`
        shares the most leading tokens with. Pages that left every tier end the match. `touch`:
        counts as a use of those pages (their recency)."""
        self.ensure_open()
        return self._match(fid, tenant, tokens, touch)

    def _match(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray, touch: bool = True
    ) -> MatchInfo:
        bs = self.fingerprints.get(fid).block_size
        m = self.index.match(fid, tenant, self._tokens(tokens), touch=touch)
        pages = with_partial(m)
        n_ok = self.pages.table.present_prefix(pages)
        return match_info(m, n_ok, bs)

    def residency(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray
    ) -> dict[str, int]:
        """Tokens of `tokens` whose KV each tier holds now. A page on two tiers (host and its
        write-through copy on disk) counts in both."""
        m = self._match(fid, tenant, tokens)
        bs = self.fingerprints.get(fid).block_size
        out = {t.value: 0 for t in Tier}
        for h, n in zip(m.pages, m.page_tokens(bs), strict=True):
            for t in self.pages.tiers_of(h):
                out[t.value] += n
        return out

    def stored_bytes(
        self, tenant: TenantId, sequences: Iterable[tuple[FingerprintId, Sequence[int] | np.ndarray]]
    ) -> int:
        """KV bytes the tenant's own pages hold for these token sequences (a session's versions):
        each distinct page once, at its uncompressed size; public prefix pages are not the tenant's
        and not counted, nor are sequences of a model this store does not know. Leaves the pages'
        recency alone (a console listing sessions must not keep them warm)."""
        seen: set[PageHash] = set()
        total = 0
        for fid, tokens in sequences:
            if fid not in self.fingerprints:
                continue
            fp = self.fingerprints.get(fid)
            info = self._match(fid, tenant, tokens, touch=False)
            for h in info.pages[info.public_tokens // fp.block_size :]:
                if h not in seen:
                    seen.add(h)
                    total += fp.page_nbytes
        return total

    def forget(self, gone: Sequence[PageHash]) -> None:
        """Pages that left the page table: unlink them from the index, and drop the pages below
        them that became unreachable."""
        if gone:
            orphans = self.index.unlink(gone)
            if orphans:
                self.pages.drop(orphans)

    # ------------------------------------------------------------------ loading
    def begin_load(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        start_token: int = 0,
        max_tokens: int | None = None,
    ) -> LoadPlan | None:
        """Match and pin the pages after `start_token` (a multiple of the block size). Pages only
        on disk are promoted into the host arena by loader threads (the plan is then async)."""
        self.ensure_open()
        bs = self.fingerprints.get(fid).block_size
        if start_token % bs:
            raise InvalidInput(f"start_token {start_token} is not a multiple of the block size {bs}")
        self._expire_stale()
        arr = self._tokens(tokens)
        query = arr if max_tokens is None else arr[: max(0, max_tokens)]
        m = self.index.match(fid, tenant, query)
        if self.pages.remote is not None and self._adopt_remote(fid, tenant, query, m):
            m = self.index.match(fid, tenant, query)
        pages = with_partial(m)
        first = start_token // bs
        if len(pages) <= first:
            return None
        held = self.pages.lease_prefix(pages)
        if len(held) <= first:
            self.pages.unlease(held)
            return None
        sizes = match_info(m, len(held), bs).page_tokens(bs)
        futures: dict[int, Future[SlotRef | None]] = {}
        tier_tokens = {t.value: 0 for t in Tier}
        plan_pages: list[PageSlot] = []
        for i in range(first, len(held)):
            ref = held[i].host_ref
            tier = Tier.HOST
            if ref is None:
                tier = Tier.REMOTE if self.pages.tiers_of(held[i].hash) == {Tier.REMOTE} else Tier.DISK
                futures[i] = self._loader.submit(self._promote, held[i].hash)
            tier_tokens[tier.value] += sizes[i]
            plan_pages.append(PageSlot(i, held[i].hash, ref, tier.value))
        load_id = uuid.uuid4().hex
        shards = self.fingerprints.get(fid).shards
        with self._lock:
            self._leases[load_id] = Lease(held, tuple(plan_pages), futures, shards)
        n_tokens = sum(sizes[first:])
        return LoadPlan(load_id, n_tokens, start_token, tuple(plan_pages), bool(futures), tier_tokens)

    def _promote(self, page: PageHash) -> SlotRef | None:
        gone: list[PageHash] = []
        from_remote = self.pages.tiers_of(page) == {Tier.REMOTE}
        try:
            ref = self.pages.promote_to_host(page, gone)
            if ref is not None and from_remote and self.writer is not None:
                self.writer.enqueue(page)  # this server's disk keeps a copy too
            return ref
        finally:
            self.forget(gone)

    def _adopt_remote(self, fid: FingerprintId, tenant: TenantId, tokens: np.ndarray, m: IndexMatch) -> bool:
        """Extend a local match with the pages the remote tier holds (`remote_pages_after`).
        Pages found enter the page table (as remote-only, promoted by the load) and the index.
        Returns whether any did. Redis unavailable: nothing found, nothing raised."""
        remote = self.pages.remote  # an unavailable one fails fast (and is tried again later)
        if remote is None or self._is_retired(tenant):
            return False
        fp = self.fingerprints.get(fid)
        own_ns = make_namespace(fid, tenant)
        find = remote_pages_after(remote, fp, own_ns, tokens, m)
        if find is None:
            return False
        # Counted like a save: an erasure of the tenant that began meanwhile refuses it, and one
        # that begins now waits until these pages are in the table and the index (then drops them).
        with self._tenant_save(tenant) as allowed:
            if not allowed:
                return False
            index_adopted(self.pages, self.index, fp, fid, own_ns, tokens, list(m.pages), find)
        return True

    def wait_loaded(
        self, load_id: str, timeout_s: float = 30.0, release: bool = False, shard: int | None = None
    ) -> tuple[PageSlot | None, ...]:
        """Every page of the plan with its host slot, or None where the page cannot be had (not
        promoted in time, or erased since it was pinned). An engine calls it again with
        `release=True` after copying: a copy that raced an erasure comes back None, never
        trusted. `shard`: the engine rank releasing (see `release`)."""
        with self._lock:
            lease = self._leases.get(load_id)
        if lease is None:
            return ()
        deadline = time.monotonic() + timeout_s
        out: list[PageSlot | None] = []
        for ps in lease.plan_pages:
            ref = ps.slot
            fut = lease.futures.get(ps.page_index)
            if fut is not None:
                try:
                    ref = fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    ref = None
            ok = ref is not None and self.pages.valid(lease.held[ps.page_index], ref)
            out.append(PageSlot(ps.page_index, ps.hash, ref) if ok else None)
        if release:
            self.release(load_id, shard)
        return tuple(out)

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
        self.pages.unlease(lease.held)

    def _expire_stale(self) -> None:
        """Free leases and reserved save slots whose engine never came back (it died mid-load or
        mid-save): otherwise their pages could never be evicted."""
        limit = time.monotonic() - self.config.lease_timeout_s
        with self._lock:
            stale_loads = [k for k, v in self._leases.items() if v.created < limit]
            stale_saves = [k for k, v in self._saves.items() if v.created < limit]
        for k in stale_loads:
            log.warning("releasing load %s: not released within %ss", k, self.config.lease_timeout_s)
            self.release(k)
        for k in stale_saves:
            log.warning("aborting save %s: not committed within %ss", k, self.config.lease_timeout_s)
            self.abort_save(k)

    # ------------------------------------------------------------------ saving
    def plan_save(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        n_pages: int,
        with_tail: bool = False,
    ) -> SavePlan:
        """Reserve host slots for the pages of `tokens[: n_pages * block_size]` that the store
        lacks. `with_tail`: the tokens after those pages, when fewer than a page, are saved too,
        as a tail page (the engine copies their whole block; its first tokens are valid)."""
        self.ensure_open()
        self._expire_stale()
        fp = self.fingerprints.get(fid)
        bs = fp.block_size
        arr = self._tokens(tokens)
        n_pages = max(0, min(n_pages, len(arr) // bs))
        n_tail = len(arr) - n_pages * bs if with_tail and len(arr) - n_pages * bs < bs else 0
        arr = arr[: n_pages * bs + n_tail]
        own_ns = make_namespace(fid, tenant)
        pub_ns = public_namespace(fid)
        pub_pages = self.index.public_match(fid, arr[: n_pages * bs]) if tenant != PUBLIC_TENANT else ()
        k_pub = len(pub_pages)
        parent = pub_pages[-1] if k_pub else ROOT_PARENT
        hashes = list(pub_pages) + chain_hashes(own_ns.id, arr, bs, parent=parent, start_page=k_pub)
        namespaces = [pub_ns] * k_pub + [own_ns] * (n_pages - k_pub)
        if n_tail:
            hashes.append(tail_hash(own_ns.id, hashes[-1] if hashes else ROOT_PARENT, arr[n_pages * bs :]))
            namespaces.append(own_ns)
        save_id = uuid.uuid4().hex
        with self._tenant_save(tenant) as allowed:
            if not allowed:
                return SavePlan(save_id, ())
            missing = set(self.pages.table.missing(hashes))
            slots: dict[int, SlotRef] = {}
            gone: list[PageHash] = []
            try:
                for i, h in enumerate(hashes):
                    if h in missing:
                        slots[i] = self.pages.reserve_host(fp.page_nbytes, gone)
            except BaseException:
                for ref in slots.values():
                    self.pages.release_host(ref)
                raise
            finally:
                self.forget(gone)
            pending = PendingSave(fid, own_ns, arr, hashes, namespaces, slots, fp.shards)
            if slots:
                with self._lock:
                    self._saves[save_id] = pending
            else:
                # Pages we already hold still need linking into this namespace's trie (e.g. the
                # user reached a page through a public prefix for the first time).
                self._link(pending)
        return SavePlan(save_id, tuple(PageSlot(i, hashes[i], ref) for i, ref in sorted(slots.items())))

    def commit_save(self, save_id: str, written: Sequence[int], shard: int = 0) -> int:
        """Record that engine rank `shard` copied its part of pages `written`; when every rank
        reported, publish the pages all of them copied. Returns how many pages were new (0 until
        the last rank's report)."""
        pending, done = self._take_save(save_id, shard, frozenset(int(i) for i in written))
        if pending is None:
            return 0
        with self._tenant_save(pending.namespace.tenant) as allowed:
            if not allowed:  # erased meanwhile (its pending saves were aborted): nothing lands
                self._free(pending)
                return 0
            return self._publish(pending, done)

    def _publish(self, pending: PendingSave, done: set[int]) -> int:
        fp = self.fingerprints.get(pending.fingerprint)
        bs = fp.block_size
        # Pages must be contiguous from 0 to be reachable: stop at the first missing one.
        upto = 0
        for i in range(len(pending.hashes)):
            if i in pending.slots and i not in done:
                break
            upto = i + 1
        new = 0
        for i, ref in sorted(pending.slots.items()):
            if i >= upto:
                self.pages.release_host(ref)
                continue
            ns = pending.namespaces[i]
            meta = PageMeta(
                hash=pending.hashes[i],
                namespace=ns.id,
                tenant=ns.tenant,
                fingerprint=pending.fingerprint,
                parent=pending.hashes[i - 1] if i else ROOT_PARENT,
                index=i,
                nbytes=fp.page_nbytes,
                tokens=pending.tokens[i * bs : (i + 1) * bs].copy(),
            )
            if self.pages.publish(meta, ref):
                new += 1
                if self.writer is not None:
                    self.writer.enqueue(meta.hash)
        pending.hashes = pending.hashes[:upto]
        pending.tokens = pending.tokens[: upto * bs]
        self._link(pending)
        if pending.namespace.is_public:
            self._apply_pins(pending.fingerprint)
        return new

    def abort_save(self, save_id: str, shard: int | None = None) -> None:
        """Rank `shard` copied nothing (its pages are not published: a page is every rank's
        shard or nothing). None aborts the whole save (no worker received it, or it expired)."""
        pending, _ = self._take_save(save_id, shard, frozenset())
        if pending is not None:
            self._free(pending)

    def _take_save(
        self, save_id: str, shard: int | None, written: frozenset[int]
    ) -> tuple[PendingSave | None, set[int]]:
        """Record a rank's report. Once every rank reported (or `shard` is None), the pending
        save is the caller's to publish or free, with the pages every rank copied; None while
        ranks are missing, if unknown, or if an erasure is zeroing its slots (the eraser then
        frees them)."""
        with self._lock:
            pending = self._saves.get(save_id)
            if pending is None:
                return None, set()
            if shard is not None:
                if not 0 <= shard < pending.shards:
                    raise InvalidInput(f"shard {shard} of a save by {pending.shards} engine ranks")
                pending.reports[shard] = pending.reports.get(shard, written) & written
                if len(pending.reports) < pending.shards:
                    return None, set()
            del self._saves[save_id]
            if pending.scrubbing:
                pending.reported = True
                return None, set()
        reports = list(pending.reports.values()) if shard is not None else [frozenset()]
        return pending, set(frozenset.intersection(*reports))

    def _free(self, pending: PendingSave) -> None:
        for ref in pending.slots.values():
            self.pages.release_host(ref)

    def _link(self, pending: PendingSave) -> None:
        """Index a saved sequence in its namespace (its leading public pages included)."""
        n = self.pages.table.present_prefix(pending.hashes)
        if n == 0:
            return
        bs = self.fingerprints.get(pending.fingerprint).block_size
        held = self.pages.lease_prefix(pending.hashes[:n])  # no eviction while we index them
        try:
            hashes = pending.hashes[: len(held)]
            cut = self.index.insert(pending.namespace, bs, pending.tokens[: len(held) * bs], hashes)
            # Leases do not stop an erasure or a corrupt-page drop: a page that left the table
            # between the lease and the insert must not stay indexed.
            self.forget(self.pages.table.missing(hashes))
        finally:
            self.pages.unlease(held)
        if cut:
            self.pages.drop(cut)

    def pending_slots(self) -> list[SlotRef]:
        with self._lock:
            return [ref for p in self._saves.values() for ref in p.slots.values()]

    # ------------------------------------------------------------------ erasure and pins
    @contextlib.contextmanager
    def _tenant_save(self, tenant: TenantId) -> Iterator[bool]:
        """Count a save of `tenant` as in flight; yields False (and counts nothing) while the
        tenant is being erased or after it was."""
        retired = self._is_retired(tenant)  # asked before our lock: locks are never nested
        with self._lock:
            if retired or tenant in self._erasing:
                allowed = False
            else:
                allowed = True
                self._active[tenant] = self._active.get(tenant, 0) + 1
        try:
            yield allowed
        finally:
            if allowed:
                with self._lock:
                    self._active[tenant] -= 1
                    if not self._active[tenant]:
                        del self._active[tenant]
                    self._quiet.notify_all()

    @contextlib.contextmanager
    def erasing(self, tenant: TenantId) -> Iterator[None]:
        """Refuse the tenant's saves, zero the ones planned, wait for the ones publishing now.

        A planned save's slots are zeroed but stay reserved until the engine reports the save
        (`commit_save`/`abort_save` then free them: the tenant is refused) or its lease expires.
        Freeing them now would let another request reserve them while the engine may still be
        copying the erased user's KV in: that late write would land in another tenant's page.
        """
        deadline = time.monotonic() + _ERASE_WAIT_S
        with self._lock:
            self._erasing[tenant] = self._erasing.get(tenant, 0) + 1
            doomed = [p for p in self._saves.values() if p.namespace.tenant == tenant]
            for p in doomed:
                p.scrubbing = True
        try:
            try:
                for p in doomed:
                    for ref in p.slots.values():
                        self.pages.zero_host(ref)
            finally:
                with self._lock:
                    for p in doomed:
                        p.scrubbing = False
                    reported = [p for p in doomed if p.reported]
                for p in reported:
                    self._free(p)
            with self._lock:
                while self._active.get(tenant):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise StorageError("saves of the user did not finish in time; erase again")
                    self._quiet.wait(left)
            yield
        finally:
            with self._lock:
                self._erasing[tenant] -= 1
                if not self._erasing[tenant]:
                    del self._erasing[tenant]

    def set_pins(self, fid: FingerprintId, token_lists: list[np.ndarray]) -> None:
        """The public prefixes of `fid` to keep pinned (their pages are never evicted)."""
        with self._lock:
            old = self._pins.get(fid, [])
            self._pins[fid] = list(token_lists)
        for tokens in old:
            self.pages.set_pinned(self._match(fid, PUBLIC_TENANT, tokens).pages, False)
        self._apply_pins(fid)

    def _apply_pins(self, fid: FingerprintId) -> None:
        with self._lock:
            token_lists = list(self._pins.get(fid, []))
        for tokens in token_lists:
            self.pages.set_pinned(self._match(fid, PUBLIC_TENANT, tokens).pages, True)

    # ------------------------------------------------------------------ in-process convenience
    def put_sequence(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        pages: Sequence[bytes | memoryview],
    ) -> int:
        """Store pages for `tokens` (page i = bytes of block i; when `tokens` end inside the last
        page, that page is stored as their tail page). Returns new pages stored."""
        fp = self.fingerprints.get(fid)
        for p in pages:
            if len(p) != fp.page_nbytes:
                raise PageShapeMismatch(f"page of {len(p)} bytes; fingerprint {fid} needs {fp.page_nbytes}")
        n_tokens = len(as_tokens(tokens))
        with_tail = n_tokens % fp.block_size != 0 and len(pages) == n_tokens // fp.block_size + 1
        n_whole = len(pages) - 1 if with_tail else len(pages)
        plan = self.plan_save(fid, tenant, tokens, n_whole, with_tail=with_tail)
        for ps in plan.pages:
            assert ps.slot is not None
            self.pages.host.slot_array(ps.slot)[:] = np.frombuffer(pages[ps.page_index], dtype=np.uint8)
        return self.commit_save(plan.save_id, [ps.page_index for ps in plan.pages])

    def load_sequence(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray
    ) -> tuple[int, list[bytes]]:
        """Tokens matched (a tail page counts its valid tokens) and a copy of each matched page's
        bytes (stops at a failed page). The copies are validated after they are taken, like an
        engine's."""
        plan = self.begin_load(fid, tenant, tokens)
        if plan is None:
            return 0, []
        copies: list[bytes] = []
        try:
            for ps in self.wait_loaded(plan.load_id):
                if ps is None or ps.slot is None:
                    break
                copies.append(self.pages.host.slot_array(ps.slot).tobytes())
        finally:
            valid = self.wait_loaded(plan.load_id, 0.0, release=True)
        n = 0
        for ps in valid[: len(copies)]:
            if ps is None:
                break
            n += 1
        return min(n * self.fingerprints.get(fid).block_size, plan.n_tokens), copies[:n]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"leases": len(self._leases), "pending_saves": len(self._saves)}
