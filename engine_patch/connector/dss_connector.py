"""`DSSConnector`: vLLM's KV connector for the dialogue state store.

Loaded by vLLM through `KVTransferConfig(kv_connector="DSSConnector",
kv_connector_module_path="engine_patch.connector.dss_connector", kv_role="kv_both",
kv_load_failure_policy="recompute", kv_connector_extra_config={"store_address": ..., "authkey": hex})`
(see `engine_patch.setup.factory`). vLLM builds one instance per role and process: the scheduler role in
the engine-core process (`scheduler_side`), the worker role beside the KV tensors
(`worker_side`). This class only wires vLLM's hooks to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from dss.namespace import ModelFingerprint
from dss.rpc import StoreClient
from dss.wire import tag_key
from engine_patch.connector.fingerprint import UnsupportedKVCache, build_fingerprint
from engine_patch.connector.kv_events import StoreEvents
from engine_patch.connector.metadata import DSSConnectorMetadata
from engine_patch.connector.orphan_guard import guard_against_orphaning
from engine_patch.connector.scheduler_side import SchedulerSide
from engine_patch.connector.worker_side import EngineRank, WorkerSide

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.dss_connector")

CONNECTOR_NAME = "DSSConnector"
CONNECTOR_MODULE = "engine_patch.connector.dss_connector"


class DSSConnector(KVConnectorBase_V1, SupportsHMA):
    """`SupportsHMA`: vLLM keeps its hybrid KV cache manager on (sliding-window layers hold only
    their window's blocks); block ids travel per KV cache group (`engine_patch.connector.groups`)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config
        address = extra.get_from_extra_config("store_address", None)
        authkey_hex = extra.get_from_extra_config("authkey", None)
        allow_uncached = bool(extra.get_from_extra_config("allow_uncached", False))
        fingerprint = self._fingerprint(vllm_config, kv_cache_config, allow_uncached)

        # Every store call has a deadline: a store that does not answer in time is a cache miss
        # (recompute), never a stalled engine step. Lookups take milliseconds when healthy.
        rpc_timeout_s = float(extra.get_from_extra_config("rpc_timeout_s", 2.0))

        def client_factory() -> StoreClient:
            return StoreClient(str(address), bytes.fromhex(str(authkey_hex)), timeout_s=rpc_timeout_s)

        factory = client_factory if address and authkey_hex else None
        if factory is None:
            logger.error("DSS connector configured without store_address/authkey; it stays off")
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._events: StoreEvents | None = None
        if role == KVConnectorRole.SCHEDULER:
            guard_against_orphaning()  # the engine core ends when the server that spawned it dies
            self._scheduler = SchedulerSide(
                fingerprint,
                factory() if factory is not None else None,
                settle_timeout_s=float(extra.get_from_extra_config("settle_timeout_s", 2.0)),
                save_after_prefill=bool(extra.get_from_extra_config("save_after_prefill", True)),
                block_ids_of=self._block_ids_of,
                tag_key=tag_key(bytes.fromhex(str(authkey_hex))) if authkey_hex else None,
            )
            self._events = self._store_events(vllm_config, fingerprint, factory)
        else:
            self._worker = WorkerSide(
                fingerprint,
                factory,
                int(kv_cache_config.num_blocks),
                load_timeout_s=float(extra.get_from_extra_config("load_timeout_s", 30.0)),
                allow_uncached=allow_uncached,
            )
        if fingerprint is not None:
            logger.info(
                "DSS connector (%s) fingerprint %s: %s", role.name.lower(), fingerprint.id, fingerprint
            )

    def _store_events(
        self,
        vllm_config: VllmConfig,
        fingerprint: ModelFingerprint | None,
        factory: Callable[[], StoreClient] | None,
    ) -> StoreEvents | None:
        """With vLLM's KV events on (`--kv-events-config`), the store's host and disk pages are
        published beside vLLM's own blocks (`engine_patch.connector.kv_events`); said in the log
        either way, never silently off."""
        config = vllm_config.kv_events_config
        if config is None or not config.enable_kv_cache_events:
            return None
        scheduler = self._scheduler
        if fingerprint is None or factory is None or scheduler is None:
            logger.warning("vLLM KV events are on but the DSS connector is off: DSS pages are not published")
            return None
        poll_s = float(self._kv_transfer_config.get_from_extra_config("kv_events_poll_s", 0.1))
        logger.info(
            "DSS KV events on: the store's host (CPU) and disk (STORAGE) pages of fingerprint %s are "
            "published with vLLM's events on %s (topic %r, block size %d, polled every %.2fs)",
            fingerprint.id,
            config.endpoint,
            config.topic,
            fingerprint.block_size,
            poll_s,
        )
        # its own client: reading events never waits behind a lookup or a save plan
        return StoreEvents(factory(), scheduler.fingerprint_id, fingerprint.block_size, poll_s=poll_s)

    @staticmethod
    def _fingerprint(
        vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, allow_uncached: bool
    ) -> ModelFingerprint | None:
        """The engine's fingerprint, or None (the connector stays off) when the operator allowed
        uncached serving. Otherwise an engine DSS cannot cache fails to start: the API process
        decides this up front (`uncached_reason`), and this is the check on the real KV cache."""
        try:
            return build_fingerprint(vllm_config, kv_cache_config)
        except UnsupportedKVCache as exc:
            if not allow_uncached:
                raise UnsupportedKVCache(
                    f"DSS cannot cache model {vllm_config.model_config.model}: {exc} "
                    "(DSS_ENGINE__ALLOW_UNCACHED=true serves it without caching)"
                ) from None
            logger.warning("DSS connector stays off (uncached serving allowed): %s", exc)
            return None

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future miss, never a wrong answer.
        return False

    # ================================================================== worker role
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
        from vllm.model_executor.models.utils import extract_layer_index

        assert self._worker is not None
        rank = EngineRank(tp_rank=get_tensor_model_parallel_rank(), pp_rank=get_pp_group().rank_in_group)
        self._worker.register_kv_caches(kv_caches, extract_layer_index, rank)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv (sync) or before the request is scheduled (async)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return  # pages are saved whole when a request finishes (wait_for_save)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving = self._worker.get_finished(finished_req_ids)
        failed = self._worker.take_failed_recving()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()) | failed,
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.build_worker_meta()

    def _meta(self) -> DSSConnectorMetadata:
        meta: KVConnectorMetadata = self._get_connector_metadata()
        assert isinstance(meta, DSSConnectorMetadata)
        return meta

    # ================================================================== scheduler role
    def _block_ids_of(self, req_id: str) -> tuple[list[int], ...]:
        """A running request's KV block ids, one list per KV cache group."""
        if self._kv_cache_manager is None:
            raise RuntimeError("vLLM did not bind its KV cache manager to the connector")
        return tuple(list(ids) for ids in self._kv_cache_manager.get_block_ids(req_id))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        return self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        """vLLM's `reset_prefix_cache(reset_connector=True)`: the store keeps its pages (they are
        durable, not this engine's cache), but vLLM has just published `AllBlocksCleared` for the
        engine, so the store's pages are announced again (a resync) at the next step."""
        if self._events is not None:
            self._events.resync()
        return None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The store's page events since the last call (vLLM publishes them with its own)."""
        return self._events.take() if self._events is not None else ()

    # ================================================================== both
    def shutdown(self) -> None:
        if self._events is not None:
            self._events.close()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
