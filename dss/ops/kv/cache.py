"""`KVCache`: the KV loads and saves engines make, over the prefix index and the tiered pages.

The named primitives follow vLLM's offloading connector: `match` (how much is stored),
`begin_load` / `wait_loaded` / `release` (pin pages, promote them into the host arena, validate
the engine's copies, unpin), and `plan_save` / `commit_save` / `abort_save` (reserve host slots
for the pages the store lacks, publish them once the engine copied them). This class builds its
parts and owns what needs more than one of them: the store being open, and expiring the leases
and saves of engines that never came back before a new load or save (`match`, `begin_load`,
`plan_save`), and whether a turn's pages reached the fleet's shared tier (`wait_shared`: the
tenant's saves, then the writer). Every other operation is called on the part that owns it,
each a public attribute:

- `lookup` (`KVLookup`, `lookup.py`): `residency`, a tenant's `stored` KV, `forget`;
- `loads` (`KVLoads`, `loads.py`): `wait_loaded`, `release`, the loader threads, remote adoption;
- `saves` (`KVSaves`, `saves.py`): `commit_save`, `abort_save`, `pending_slots`, and the
  erasure's side of saves (`erasing`);
- `pins` (`PublicPins`, `pins.py`): `set_pins`, the public prefixes kept pinned;
- `TenantGate` (`tenant_gate.py`): which tenants may save now, and their saves in flight;
- `writer`: the `DiskWriter` (`writeback.py`) when write-through is on.

Locks: each part's lock is a leaf around its own registry; no part calls another while holding
its lock. The order of calls between the parts, never nested: index → page table → tiers (inside
`TieredPages`) → index again (`KVLookup.forget`).

Erasure cooperates through `saves.erasing(tenant)`: while it is held, saves of the tenant are refused
and the saves already in flight have finished, so nothing of the tenant is published behind the
erasure's back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from dss.config import StoreConfig
from dss.errors import StoreClosed
from dss.index.fingerprints import FingerprintRegistry
from dss.index.prefix_index import PrefixIndex
from dss.ops.kv.loads import KVLoads
from dss.ops.kv.lookup import KVLookup
from dss.ops.kv.matching import MatchInfo
from dss.ops.kv.pins import PublicPins
from dss.ops.kv.saves import KVSaves
from dss.ops.kv.tenant_gate import TenantGate
from dss.ops.kv.writeback import DiskWriter
from dss.pages.placement import TieredPages
from dss.tokens import as_tokens
from dss.types import FingerprintId, TenantId
from dss.wire import LoadPlan, PlannedLoad, SavePlan, tokens_digest


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
        remote = config.remote
        shared = remote.url is not None and remote.write_behind
        self._durable_wait_s = remote.durable_wait_s if shared else 0.0
        self._fingerprints = fingerprints
        self._pages = pages
        self.lookup = KVLookup(config, fingerprints, index, pages)
        write_through = config.write_through and (pages.disk is not None or pages.remote is not None)
        self.writer = DiskWriter(pages, self.lookup.forget) if write_through else None
        gate = TenantGate(is_retired)
        self.pins = PublicPins(self.lookup, pages)
        threads = config.loader_threads
        self.loads = KVLoads(fingerprints, index, pages, self.lookup, gate, threads)
        self.saves = KVSaves(fingerprints, index, pages, self.lookup, gate, self.writer, self.pins.apply)
        self._closed = False

    def wait_shared(self, tenant: TenantId) -> bool | None:
        """Wait until the pages of the tenant's saves so far are in the remote tier: every save
        planned before this call published (the engine reported it), then every page published
        before it written behind. Bounded by `RemoteConfig.durable_wait_s`. None: nothing to wait
        for (no remote tier, no write-behind, or a wait of 0); False: the wait ran out. A page the
        write-behind could not write (Redis unavailable) counts as done: it is a remote miss later
        (`dss_remote_errors_total`), never a wait."""
        if self._durable_wait_s <= 0 or self.writer is None:
            return None
        deadline = time.monotonic() + self._durable_wait_s
        if not self.saves.wait_settled(tenant, deadline):
            return False
        return self.writer.wait_through(self.writer.ticket(), deadline)

    def close(self) -> None:
        self._closed = True
        self.loads.close()
        if self.writer is not None:
            self.writer.close()

    def ensure_open(self) -> None:
        """`StoreClosed` once `close` ran: what a match, load, save or erasure meets then."""
        if self._closed:
            raise StoreClosed("the store is closed")

    def _expire_stale(self) -> None:
        """Free leases and reserved save slots whose engine never came back (it died mid-load or
        mid-save): otherwise their pages could never be evicted."""
        self.loads.expire_stale(self._lease_timeout_s)
        self.saves.expire_stale(self._lease_timeout_s)

    # ------------------------------------------------------------------ what needs the whole cache
    def match(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray, touch: bool = True
    ) -> MatchInfo:
        """The longest stored prefix of `tokens` for the tenant (`KVLookup.stored_prefix`), once the
        store is open."""
        self.ensure_open()
        return self.lookup.stored_prefix(fid, tenant, tokens, touch)

    def begin_load(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        start_token: int = 0,
        max_tokens: int | None = None,
    ) -> LoadPlan | None:
        """Match and pin the pages after `start_token` (`KVLoads.pin`), once the store is open and
        stale leases and saves are expired."""
        self.ensure_open()
        self._expire_stale()
        return self.loads.pin(fid, tenant, tokens, start_token, max_tokens)

    def plan_ahead(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int] | np.ndarray
    ) -> PlannedLoad | None:
        """The load of a request's whole prompt, planned by the process that sends the request to
        the engine: `begin_load(fid, tenant, tokens, 0, len(tokens) - 1)`, to travel with the
        request (`SessionTag.planned_load`) so that the engine's scheduler asks the store nothing.
        None when there is nothing to load, and in a store with a remote tier, where planning may
        wait for Redis (a prefetch, the fleet's pages), which the sender's event loop must not:
        the engine's own lookup does that. The plan's lease is the sender's to end
        (`drop_planned`), once the engine answered the request's first token or the request is
        gone: the engine neither releases nor checks it with the store."""
        if self._pages.remote is not None or len(tokens) < 2:
            return None
        planned_at = time.monotonic()  # before: a save that lands meanwhile counts as after it
        arr = as_tokens(tokens)  # once: matched, and digested in place
        plan = self.begin_load(fid, tenant, arr, 0, len(arr) - 1)
        return None if plan is None else PlannedLoad(str(fid), tokens_digest(arr), plan, planned_at)

    def drop_planned(self, planned: PlannedLoad) -> None:
        """End the lease of a plan: its request's first token is back (the engine's workers
        copied its pages before computing it), or the request failed or was never sent."""
        self.loads.release(planned.plan.load_id)

    def plan_save(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        n_pages: int,
        *,
        with_tail: bool = False,
    ) -> SavePlan:
        """Reserve host slots for the pages the store lacks (`KVSaves.reserve`), once the store is
        open and stale leases and saves are expired."""
        self.ensure_open()
        self._expire_stale()
        return self.saves.reserve(fid, tenant, tokens, n_pages, with_tail)

    def stats(self) -> dict[str, int]:
        return {"leases": self.loads.count(), "pending_saves": self.saves.count()}
