"""What the RPC serves: `StoreService`, the calls an engine process may make, and `EngineCalls`,
the adapter that answers them from the KV cache, the fingerprint registry and the store's stats.

The adapter is the explicit table of what crosses: nothing else of the owner is reachable from an
engine process. It knows the parts only through the small protocols below (`KVService`), so the
RPC package imports no part of the store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from dss.namespace import ModelFingerprint
from dss.types import FingerprintId, TenantId
from dss.wire import LoadPlan, PageSlot, SavePlan


class StoreService(Protocol):
    """What `StoreServer` calls (`EngineCalls` implements it; tests pass fakes)."""

    def register_fingerprint(self, fp: ModelFingerprint) -> str: ...

    def begin_load(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: np.ndarray,
        start_token: int,
        max_tokens: int,
    ) -> LoadPlan | None: ...

    def wait_loaded(
        self, load_id: str, timeout_s: float, *, release: bool = False, shard: int | None = None
    ) -> tuple[PageSlot | None, ...]: ...

    def release(self, load_id: str, shard: int | None = None) -> None: ...

    def plan_save(
        self, fid: FingerprintId, tenant: TenantId, tokens: np.ndarray, n_pages: int, with_tail: bool = False
    ) -> SavePlan: ...

    def commit_save(self, save_id: str, written: Sequence[int], shard: int = 0) -> int: ...

    def abort_save(self, save_id: str, shard: int | None = None) -> None: ...

    def stats(self) -> Mapping[str, Any]: ...


class KVService(Protocol):
    """The part of `dss.ops.kv.KVCache` that engines use: loads, saves and their leases."""

    def begin_load(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        start_token: int = 0,
        max_tokens: int | None = None,
    ) -> LoadPlan | None: ...

    def wait_loaded(
        self, load_id: str, timeout_s: float = 30.0, *, release: bool = False, shard: int | None = None
    ) -> tuple[PageSlot | None, ...]: ...

    def release(self, load_id: str, shard: int | None = None) -> None: ...

    def plan_save(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: Sequence[int] | np.ndarray,
        n_pages: int,
        with_tail: bool = False,
    ) -> SavePlan: ...

    def commit_save(self, save_id: str, written: Sequence[int], shard: int = 0) -> int: ...

    def abort_save(self, save_id: str, shard: int | None = None) -> None: ...


class EngineCalls:
    """`StoreService` over the owner's parts: each method is one call an engine process may make."""

    def __init__(
        self,
        kv: KVService,
        register_fingerprint: Callable[[ModelFingerprint], FingerprintId],
        stats: Callable[[], Mapping[str, Any]],
    ) -> None:
        self._kv = kv
        self._register_fingerprint = register_fingerprint
        self._stats = stats

    def register_fingerprint(self, fp: ModelFingerprint) -> str:
        return str(self._register_fingerprint(fp))

    def begin_load(
        self, fid: FingerprintId, tenant: TenantId, tokens: np.ndarray, start_token: int, max_tokens: int
    ) -> LoadPlan | None:
        return self._kv.begin_load(fid, tenant, tokens, start_token, max_tokens)

    def wait_loaded(
        self, load_id: str, timeout_s: float, *, release: bool = False, shard: int | None = None
    ) -> tuple[PageSlot | None, ...]:
        return self._kv.wait_loaded(load_id, timeout_s, release=release, shard=shard)

    def release(self, load_id: str, shard: int | None = None) -> None:
        self._kv.release(load_id, shard)

    def plan_save(
        self, fid: FingerprintId, tenant: TenantId, tokens: np.ndarray, n_pages: int, with_tail: bool = False
    ) -> SavePlan:
        return self._kv.plan_save(fid, tenant, tokens, n_pages, with_tail)

    def commit_save(self, save_id: str, written: Sequence[int], shard: int = 0) -> int:
        return self._kv.commit_save(save_id, written, shard)

    def abort_save(self, save_id: str, shard: int | None = None) -> None:
        self._kv.abort_save(save_id, shard)

    def stats(self) -> Mapping[str, Any]:
        return self._stats()
