"""`KVSaves`: an engine's saves. `plan_save` reserves host slots for the pages the store lacks (a
`PendingSave`); `commit_save` / `abort_save` record each engine rank's report, and once every
rank reported, the pages all of them copied are published (page table, write-through, index).

Invariants: a page is published only when every rank copied its shard, and only contiguously from
page 0 (a later page is unreachable without the earlier ones). A pending save's slots are not
reused before every rank reported, or its lease expired: a rank may still be writing into them.
An erasure of the tenant (`erasing`) zeroes the planned saves' slots, refuses new saves and waits
for the ones publishing now (`TenantGate`); slots it zeroes stay reserved until the save is
reported, then the eraser or the reporter frees them.

A save is *unsettled* from its plan until its report was published or freed (`wait_settled`:
a turn's commit waits for its tenant's saves before it waits for the writer, `KVCache.wait_shared`).

Lock: `KVSaves._lock` is a leaf around the pending saves (and their `scrubbing`/`reported`
flags) and the unsettled ones (`_settled`, a condition on it). The index, the page table and the
tiers are called with no lock held.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from dss.errors import InvalidInput
from dss.index.fingerprints import FingerprintRegistry
from dss.index.hashing import ROOT_PARENT, chain_hashes
from dss.index.prefix_index import PrefixIndex
from dss.index.tails import tail_hash
from dss.namespace import make_namespace, public_namespace
from dss.ops.kv.in_flight import PendingSave
from dss.ops.kv.lookup import KVLookup
from dss.ops.kv.tenant_gate import TenantGate
from dss.ops.kv.writeback import DiskWriter
from dss.pages.meta import PageMeta
from dss.pages.placement import TieredPages
from dss.types import PUBLIC_TENANT, FingerprintId, PageHash, TenantId
from dss.wire import PageSlot, SavePlan, SlotRef

log = logging.getLogger("dss.kv")

_ERASE_WAIT_S = 30.0


class KVSaves:
    def __init__(
        self,
        fingerprints: FingerprintRegistry,
        index: PrefixIndex,
        pages: TieredPages,
        lookup: KVLookup,
        gate: TenantGate,
        writer: DiskWriter | None,
        on_public_saved: Callable[[FingerprintId], None] = lambda _fid: None,
    ) -> None:
        self._fingerprints = fingerprints
        self._index = index
        self._pages = pages
        self._lookup = lookup
        self._gate = gate
        self._writer = writer
        self._on_public_saved = on_public_saved  # pins of public prefixes reach the new pages
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._unsettled: dict[str, TenantId] = {}  # save id -> its tenant, until published or freed
        self._saves: dict[str, PendingSave] = {}

    def reserve(
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
        fp = self._fingerprints.get(fid)
        bs = fp.block_size
        arr = self._lookup.tokens(tokens)
        n_pages = max(0, min(n_pages, len(arr) // bs))
        n_tail = len(arr) - n_pages * bs if with_tail and len(arr) - n_pages * bs < bs else 0
        arr = arr[: n_pages * bs + n_tail]
        own_ns = make_namespace(fid, tenant)
        pub_ns = public_namespace(fid)
        pub_pages = self._index.public_match(fid, arr[: n_pages * bs]) if tenant != PUBLIC_TENANT else ()
        k_pub = len(pub_pages)
        parent = pub_pages[-1] if k_pub else ROOT_PARENT
        hashes = list(pub_pages) + chain_hashes(own_ns.id, arr, bs, parent=parent, start_page=k_pub)
        namespaces = [pub_ns] * k_pub + [own_ns] * (n_pages - k_pub)
        if n_tail:
            hashes.append(tail_hash(own_ns.id, hashes[-1] if hashes else ROOT_PARENT, arr[n_pages * bs :]))
            namespaces.append(own_ns)
        save_id = uuid.uuid4().hex
        with self._gate.saving(tenant) as allowed:
            if not allowed:
                return SavePlan(save_id, ())
            missing = set(self._pages.table.missing(hashes))
            slots: dict[int, SlotRef] = {}
            gone: list[PageHash] = []
            try:
                for i, h in enumerate(hashes):
                    if h in missing:
                        slots[i] = self._pages.reserve_host(fp.page_nbytes, gone)
            except BaseException:
                for ref in slots.values():
                    self._pages.release_host(ref)
                raise
            finally:
                self._lookup.forget(gone)
            pending = PendingSave(fid, own_ns, arr, hashes, namespaces, slots, fp.shards)
            if slots:
                with self._lock:
                    self._saves[save_id] = pending
                    self._unsettled[save_id] = tenant
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
        try:
            with self._gate.saving(pending.namespace.tenant) as allowed:
                if not allowed:  # erased meanwhile (its pending saves were aborted): nothing lands
                    self._free(pending)
                    return 0
                return self._publish(pending, done)
        finally:
            self._settle(save_id)

    def abort_save(self, save_id: str, shard: int | None = None) -> None:
        """Rank `shard` copied nothing (its pages are not published: a page is every rank's
        shard or nothing). None aborts the whole save (no worker received it, or it expired)."""
        pending, _ = self._take_save(save_id, shard, frozenset())
        if pending is not None:
            try:
                self._free(pending)
            finally:
                self._settle(save_id)

    def _settle(self, save_id: str) -> None:
        with self._lock:
            self._unsettled.pop(save_id, None)
            self._settled.notify_all()

    def wait_settled(self, tenant: TenantId, deadline: float) -> bool:
        """Wait until every save of `tenant` planned before this call was published or freed,
        at most until `deadline` (`time.monotonic()`). True when they were."""
        with self._lock:
            mine = {k for k, t in self._unsettled.items() if t == tenant}
            while mine & self._unsettled.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._settled.wait(left)
            return True

    def _publish(self, pending: PendingSave, done: set[int]) -> int:
        fp = self._fingerprints.get(pending.fingerprint)
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
                self._pages.release_host(ref)
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
            if self._pages.publish(meta, ref):
                new += 1
                if self._writer is not None:
                    self._writer.enqueue(meta.hash)
        pending.hashes = pending.hashes[:upto]
        pending.tokens = pending.tokens[: upto * bs]
        self._link(pending)
        if pending.namespace.is_public:
            self._on_public_saved(pending.fingerprint)
        return new

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
            if pending.scrubbing:  # erased: nothing of it lands, and the eraser frees its slots
                pending.reported = True
                self._unsettled.pop(save_id, None)
                self._settled.notify_all()
                return None, set()
        reports = list(pending.reports.values()) if shard is not None else [frozenset()]
        return pending, set(frozenset.intersection(*reports))

    def _free(self, pending: PendingSave) -> None:
        for ref in pending.slots.values():
            self._pages.release_host(ref)

    def _link(self, pending: PendingSave) -> None:
        """Index a saved sequence in its namespace (its leading public pages included)."""
        n = self._pages.table.present_prefix(pending.hashes)
        if n == 0:
            return
        bs = self._fingerprints.get(pending.fingerprint).block_size
        held = self._pages.lease_prefix(pending.hashes[:n])  # no eviction while we index them
        try:
            hashes = pending.hashes[: len(held)]
            cut = self._index.insert(pending.namespace, bs, pending.tokens[: len(held) * bs], hashes)
            # Leases do not stop an erasure or a corrupt-page drop: a page that left the table
            # between the lease and the insert must not stay indexed.
            self._lookup.forget(self._pages.table.missing(hashes))
        finally:
            self._pages.unlease(held)
        if cut:
            self._pages.copies.drop(cut)

    @contextlib.contextmanager
    def erasing(self, tenant: TenantId) -> Iterator[None]:
        """Refuse the tenant's saves, zero the ones planned, wait for the ones publishing now.

        A planned save's slots are zeroed but stay reserved until the engine reports the save
        (`commit_save`/`abort_save` then free them: the tenant is refused) or its lease expires.
        Freeing them now would let another request reserve them while the engine may still be
        copying the erased user's KV in: that late write would land in another tenant's page.
        """
        deadline = time.monotonic() + _ERASE_WAIT_S
        # The gate refuses first, then `_scrub` looks: a save missing from the look was allowed
        # before the erasure began, and `wait_quiet` waits until its plan or commit is done.
        with self._gate.erasing(tenant):
            self._scrub(tenant)
            self._gate.wait_quiet(tenant, deadline)
            yield

    def _scrub(self, tenant: TenantId) -> None:
        """Zero the slots of the tenant's planned saves; free those reported meanwhile."""
        with self._lock:
            doomed = [p for p in self._saves.values() if p.namespace.tenant == tenant]
            for p in doomed:
                p.scrubbing = True
        try:
            for p in doomed:
                for ref in p.slots.values():
                    self._pages.zero_host(ref)
        finally:
            with self._lock:
                for p in doomed:
                    p.scrubbing = False
                reported = [p for p in doomed if p.reported]
            for p in reported:
                self._free(p)

    def expire_stale(self, timeout_s: float) -> None:
        """Abort the saves older than `timeout_s` (their engine died mid-save): otherwise their
        reserved slots could never be reused."""
        limit = time.monotonic() - timeout_s
        with self._lock:
            stale = [k for k, v in self._saves.items() if v.created < limit]
        for k in stale:
            log.warning("aborting save %s: not committed within %ss", k, timeout_s)
            self.abort_save(k)

    def pending_slots(self) -> list[SlotRef]:
        with self._lock:
            return [ref for p in self._saves.values() for ref in p.slots.values()]

    def count(self) -> int:
        with self._lock:
            return len(self._saves)
