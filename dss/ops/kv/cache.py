"""`KVCache`: the KV loads and saves engines make, over the prefix index and the tiered pages.

The named primitives follow vLLM's offloading connector: `match` (how much is stored),
`begin_load` / `wait_loaded` / `release` (pin pages, promote them into the host arena, validate
the engine's copies, unpin), and `plan_save` / `commit_save` / `abort_save` (reserve host slots
for the pages the store lacks, publish them once the engine copied them). This class only puts
its parts together and is the one surface callers use (the RPC's `EngineCalls`, `Store.kv`):

- `KVLookup` (`lookup.py`): match, residency, a tenant's stored KV, `forget`;
- `KVLoads` (`loads.py`): loads and their leases, the loader threads, remote adoption;
- `KVSaves` (`saves.py`): saves pending and published, and the erasure's side of them;
- `TenantGate` (`gate.py`): which tenants may save now, and their saves in flight;
- `PublicPins` (`pins.py`): the public prefixes kept pinned;
- the `DiskWriter` (`dss/ops/writeback.py`) when write-through is on.

Locks: each part's lock is a leaf around its own registry; no part calls another while holding
its lock. The order of calls between the parts, never nested: index → page table → tiers (inside
`TieredPages`) → index again (`KVLookup.forget`).

Erasure cooperates through `erasing(tenant)`: while it is held, saves of the tenant are refused
and the saves already in flight have finished, so nothing of the tenant is published behind the
erasure's back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager

import numpy as np

from dss.config import StoreConfig
from dss.errors import PageShapeMismatch, StoreClosed
from dss.index.fingerprints import FingerprintRegistry
from dss.index.prefix_index import PrefixIndex
from dss.ops.kv.gate import TenantGate
from dss.ops.kv.loads import KVLoads
from dss.ops.kv.lookup import KVLookup, StoredKV
from dss.ops.kv.matching import MatchInfo
from dss.ops.kv.pins import PublicPins
from dss.ops.kv.saves import KVSaves
from dss.ops.writeback import DiskWriter
from dss.pages.tiered import TieredPages
from dss.tokens import as_tokens
from dss.types import FingerprintId, PageHash, TenantId
from dss.wire import LoadPlan, PageSlot, SavePlan, SlotRef


class KVCache:
    def __init__(
        self,
        config: StoreConfig,
        fingerprints: FingerprintRegistry,
        index: PrefixIndex,
        pages: TieredPages,
        is_retired: Callable[[TenantId], bool] = lambda _tenant: False,
    ) -> None:
        self._lease_timeout_s = config.lease_timeout_s
        self._fingerprints = fingerprints
        self._pages = pages
        self._lookup = KVLookup(config, fingerprints, index, pages)
        write_through = config.write_through and (pages.disk is not None or pages.remote is not None)
        self.writer = DiskWriter(pages, self._lookup.forget) if write_through else None
        gate = TenantGate(is_retired)
        self._pins = PublicPins(self._lookup, pages)
        threads = config.loader_threads
        self._loads = KVLoads(fingerprints, index, pages, self._lookup, gate, self.writer, threads)
        self._saves = KVSaves(fingerprints, index, pages, self._lookup, gate, self.writer, self._pins.apply)
        self._closed = False

    def close(self) -> None:
        self._closed = True
        self._loads.close()
        if self.writer is not None:
            self.writer.close()

    def ensure_open(self) -> None:
        """`StoreClosed` once `close` ran: what a match, load, save or erasure meets then."""
        if self._closed:
            raise StoreClosed("the store is closed")

    def _expire_stale(self) -> None:
        """Free leases and reserved save slots whose engine never came back (it died mid-load or
        mid-save): otherwise their pages could never be evicted."""
        self._loads.expire_stale(self._lease_timeout_s)
        self._saves.expire_stale(self._lease_timeout_s)

    # ------------------------------------------------------------------ reads (`KVLookup`)
    def match(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray, touch: bool = True
    ) -> MatchInfo:
        """`KVLookup.match`: the longest stored prefix of `tokens` for the tenant."""
        self.ensure_open()
        return self._lookup.match(fid, tenant, tokens, touch)

    def residency(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray
    ) -> dict[str, int]:
        """`KVLookup.residency`: tokens of `tokens` whose KV each tier holds now."""
        return self._lookup.residency(fid, tenant, tokens)

    def stored(
        self, tenant: TenantId, sequences: Iterable[tuple[FingerprintId, Sequence[int] | np.ndarray]]
    ) -> StoredKV:
        """`KVLookup.stored`: the tenant's own pages for these sequences, each once."""
        return self._lookup.stored(tenant, sequences)

    def forget(self, gone: Sequence[PageHash]) -> None:
        """`KVLookup.forget`: pages that left the page table leave the index."""
        self._lookup.forget(gone)

    # ------------------------------------------------------------------ loads (`KVLoads`)
    def begin_load(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        start_token: int = 0,
        max_tokens: int | None = None,
    ) -> LoadPlan | None:
        """`KVLoads.begin_load`: match and pin the pages after `start_token`."""
        self.ensure_open()
        self._expire_stale()
        return self._loads.begin_load(fid, tenant, tokens, start_token, max_tokens)

    def wait_loaded(
        self, load_id: str, timeout_s: float = 30.0, release: bool = False, shard: int | None = None
    ) -> tuple[PageSlot | None, ...]:
        """`KVLoads.wait_loaded`: the plan's pages with their host slots (None: not to be had)."""
        return self._loads.wait_loaded(load_id, timeout_s, release, shard)

    def release(self, load_id: str, shard: int | None = None) -> None:
        """`KVLoads.release`: end rank `shard`'s part of a lease (None: all of it)."""
        self._loads.release(load_id, shard)

    # ------------------------------------------------------------------ saves (`KVSaves`)
    def plan_save(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        n_pages: int,
        with_tail: bool = False,
    ) -> SavePlan:
        """`KVSaves.plan_save`: reserve host slots for the pages the store lacks."""
        self.ensure_open()
        self._expire_stale()
        return self._saves.plan_save(fid, tenant, tokens, n_pages, with_tail)

    def commit_save(self, save_id: str, written: Sequence[int], shard: int = 0) -> int:
        """`KVSaves.commit_save`: rank `shard` copied `written`; returns the pages published."""
        return self._saves.commit_save(save_id, written, shard)

    def abort_save(self, save_id: str, shard: int | None = None) -> None:
        """`KVSaves.abort_save`: rank `shard` copied nothing (None: abort the whole save)."""
        self._saves.abort_save(save_id, shard)

    def pending_slots(self) -> list[SlotRef]:
        """Host slots reserved by saves not yet reported (`TieredPages.check` allows for them)."""
        return self._saves.pending_slots()

    def erasing(self, tenant: TenantId) -> AbstractContextManager[None]:
        """`KVSaves.erasing`: no save of the tenant is planned, copied or published meanwhile."""
        return self._saves.erasing(tenant)

    # ------------------------------------------------------------------ pins (`PublicPins`)
    def set_pins(self, fid: FingerprintId, token_lists: list[np.ndarray]) -> None:
        """`PublicPins.set_pins`: the public prefixes of `fid` to keep pinned."""
        self._pins.set_pins(fid, token_lists)

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
        fp = self._fingerprints.get(fid)
        for p in pages:
            if len(p) != fp.page_nbytes:
                raise PageShapeMismatch(f"page of {len(p)} bytes; fingerprint {fid} needs {fp.page_nbytes}")
        n_tokens = len(as_tokens(tokens))
        with_tail = n_tokens % fp.block_size != 0 and len(pages) == n_tokens // fp.block_size + 1
        n_whole = len(pages) - 1 if with_tail else len(pages)
        plan = self.plan_save(fid, tenant, tokens, n_whole, with_tail=with_tail)
        for ps in plan.pages:
            assert ps.slot is not None
            self._pages.host.slot_array(ps.slot)[:] = np.frombuffer(pages[ps.page_index], dtype=np.uint8)
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
                copies.append(self._pages.host.slot_array(ps.slot).tobytes())
        finally:
            valid = self.wait_loaded(plan.load_id, 0.0, release=True)
        n = 0
        for ps in valid[: len(copies)]:
            if ps is None:
                break
            n += 1
        return min(n * self._fingerprints.get(fid).block_size, plan.n_tokens), copies[:n]

    def stats(self) -> dict[str, int]:
        return {"leases": self._loads.count(), "pending_saves": self._saves.count()}
