"""What an engine process may call on the store: `EngineStore`, the one contract.

Defined once, here. The owner's side serves it from the parts that own each call
(`dss.store.Store.engine_calls`, an `EngineCalls` table of their bound methods); the RPC pair
follows it: `StoreServer` decodes each call's wire arguments and answers from an `EngineStore`,
and `StoreClient` implements `EngineStore` over the socket (mypy checks that it does, below).
Nothing else of the owner is reachable from an engine process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dss.namespace import ModelFingerprint
from dss.types import FingerprintId, TenantId
from dss.wire import LoadPlan, PageEventBatch, PageSlot, SavePlan


class EngineStore(Protocol):
    """The calls of the KV path, in the order an engine makes them: a model registers its
    fingerprint; a request's lookup pins the stored pages after what the engine holds
    (`begin_load`), the workers wait for the pages being promoted and copy them (`wait_loaded`),
    then end their part of the lease and learn how far their copies can be trusted in one round
    trip (`release_checked`); pages already in the host arena are copied and checked by the slots'
    generations alone, and their lease ended (`release`) off the turn's path, as is a lease given
    back unused; a finished request reserves
    host slots for the pages the store lacks (`plan_save`), each rank reports what it copied
    (`commit_save`) or that it copied nothing (`abort_save`); with KV events on, the scheduler
    reads the page events of its fingerprint (`take_events`). `shard` is the engine rank
    (tensor/pipeline parallel engines report one part each)."""

    def register_fingerprint(self, fp: ModelFingerprint) -> FingerprintId: ...

    def begin_load(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        start_token: int,
        max_tokens: int,
    ) -> LoadPlan | None: ...

    def wait_loaded(self, load_id: str, timeout_s: float) -> tuple[PageSlot | None, ...]: ...

    def release(self, load_id: str, *, shard: int | None = None) -> None: ...

    def release_checked(self, load_id: str, *, shard: int | None = None) -> int:
        """End this rank's part of the lease after copying: how many of the plan's pages, from
        the first, are still the pages it leased (a copy taken before the call is good that far;
        one that raced an erasure is not). A count, not the pages: the answer an engine waits
        for after every load, kept small."""
        ...

    def plan_save(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        n_pages: int,
        *,
        with_tail: bool = False,
    ) -> SavePlan: ...

    def commit_save(self, save_id: str, written: Sequence[int], *, shard: int = 0) -> int: ...

    def abort_save(self, save_id: str, *, shard: int | None = None) -> None: ...

    def stats(self) -> Mapping[str, Any]: ...

    def take_events(self, fid: FingerprintId, epoch: str, after: int, limit: int = 4096) -> PageEventBatch:
        """The host and disk page events of fingerprint `fid` after id `after` of log `epoch`, or
        a resync (`dss.pages.events`); the connector publishes them as vLLM KV events."""
        ...


@dataclass(frozen=True, slots=True)
class EngineCalls:
    """`EngineStore` answered by the parts that own each call: a table of their bound methods,
    no method of its own (so no call is defined twice on the owner's side).
    `tests/dss/rpc/test_rpc.py` checks that each entry takes the contract's parameters."""

    register_fingerprint: Callable[[ModelFingerprint], FingerprintId]
    begin_load: Callable[..., LoadPlan | None]
    wait_loaded: Callable[..., tuple[PageSlot | None, ...]]
    release: Callable[..., None]
    release_checked: Callable[..., int]
    plan_save: Callable[..., SavePlan]
    commit_save: Callable[..., int]
    abort_save: Callable[..., None]
    stats: Callable[[], Mapping[str, Any]]
    take_events: Callable[..., PageEventBatch]


ENGINE_CALLS: tuple[str, ...] = tuple(f.name for f in fields(EngineCalls))

if TYPE_CHECKING:  # mypy checks that the table serves the contract

    def _table_serves_the_contract(calls: EngineCalls) -> EngineStore:
        return calls
