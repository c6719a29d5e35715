"""Build vLLM engines wired to a DSS store: `LLM` for scripts and tests, `AsyncLLM` for the server.

The store lives in the calling process (it owns the data directory); the engine's processes reach
it through the store's local RPC address and authkey, passed in the connector's extra config.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dss.types import TenantId
from dss.wire import SessionTag, tag_key
from engine_patch.connector import CONNECTOR_MODULE, CONNECTOR_NAME

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM


@dataclass(frozen=True, slots=True)
class EngineSettings:
    model: Path
    max_model_len: int = 4096
    kv_cache_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU (vLLM reads whole GiB)
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    block_size: int | None = None  # platform default (128 on CPU)
    num_gpu_blocks_override: int | None = None
    # float32: in bfloat16 the default model's greedy answers drift from its full-precision ones
    # (the README's France question tips to "L'Étoile..."); `dss model pull` verifies in this
    # dtype. Costs and numbers: docs/operations.md, "Served dtype" (bench/served_dtype.py).
    dtype: str = "float32"
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    served_model_name: str | None = None
    connector: bool = True  # False: plain vLLM (benchmarks' baselines)
    load_timeout_s: float = 30.0
    rpc_timeout_s: float = 2.0  # deadline of each store call from the engine (then: a miss)
    settle_timeout_s: float = 2.0
    save_after_prefill: bool = True
    # False: an engine the connector cannot cache fails to start; True: it serves uncached.
    allow_uncached: bool = False
    extra_engine_args: dict[str, Any] = field(default_factory=dict)


def kv_transfer_config(store_address: str, authkey: bytes, settings: EngineSettings) -> KVTransferConfig:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector=CONNECTOR_NAME,
        kv_connector_module_path=CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "store_address": store_address,
            "authkey": authkey.hex(),
            "load_timeout_s": settings.load_timeout_s,
            "rpc_timeout_s": settings.rpc_timeout_s,
            "settle_timeout_s": settings.settle_timeout_s,
            "save_after_prefill": settings.save_after_prefill,
            "allow_uncached": settings.allow_uncached,
        },
    )


def engine_kwargs(
    store_address: str | None, authkey: bytes | None, settings: EngineSettings
) -> dict[str, Any]:
    """Keyword arguments shared by `LLM(...)` and `AsyncEngineArgs(...)`."""
    kwargs: dict[str, Any] = {
        "model": str(settings.model),
        "max_model_len": settings.max_model_len,
        "enforce_eager": settings.enforce_eager,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "dtype": settings.dtype,
        "seed": settings.seed,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
    }
    optional = {
        "block_size": settings.block_size,
        "num_gpu_blocks_override": settings.num_gpu_blocks_override,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "served_model_name": settings.served_model_name,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    kwargs.update(_whole_prefills_on_cpu(settings))
    if settings.connector:
        if store_address is None or authkey is None:
            raise ValueError("the DSS connector needs the store's RPC address and authkey")
        kwargs["kv_transfer_config"] = kv_transfer_config(store_address, authkey, settings)
    kwargs.update(settings.extra_engine_args)
    return kwargs


def _whole_prefills_on_cpu(settings: EngineSettings) -> dict[str, Any]:
    """On the CPU platform, prefills are never split across engine steps.

    After a step that ran only part of a prompt, vLLM drops the token it sampled there and rewinds
    a seeded request's generator (`torch.Generator.set_offset`). CPU generators have no offset:
    the engine core raised "CPU Generator does not use offset" and died, for every user, as soon
    as one request with a `seed` had its prefill split (a long prompt, or a few arriving
    together). vLLM itself schedules whole prefills on CPU for MLA models; the same here for all.
    `extra_engine_args` may still override both values."""
    from vllm.config import SchedulerConfig
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    budget = max(
        settings.max_model_len,
        settings.max_num_batched_tokens or 0,
        SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS,
    )
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}


def _prepare_environment(settings: EngineSettings) -> None:
    # Read by the engine processes vLLM spawns, which inherit the environment.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(settings.kv_cache_space_gib))
    # Out-of-tree connector modules are imported by name in every engine process.
    root = str(Path(__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH", "")
    if root not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, path) if p)


def build_llm(store_address: str | None, authkey: bytes | None, settings: EngineSettings) -> LLM:
    _prepare_environment(settings)
    from vllm import LLM

    return LLM(**engine_kwargs(store_address, authkey, settings))


def async_engine_args(
    store_address: str | None, authkey: bytes | None, settings: EngineSettings
) -> AsyncEngineArgs:
    _prepare_environment(settings)
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**engine_kwargs(store_address, authkey, settings))


def build_async_engine(
    store_address: str | None,
    authkey: bytes | None,
    settings: EngineSettings,
    check: Callable[[VllmConfig], None] | None = None,
) -> AsyncLLM:
    """`AsyncLLM.from_engine_args`, with `check` run on the resolved config before any engine
    process starts (it raises to refuse the engine)."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.executor import Executor

    args = async_engine_args(store_address, authkey, settings)
    usage = UsageContext.ENGINE_CONTEXT
    vllm_config = args.create_engine_config(usage)
    if check is not None:
        check(vllm_config)
    return AsyncLLM(
        vllm_config=vllm_config,
        executor_class=Executor.get_class(vllm_config),
        log_requests=args.enable_log_requests,
        log_stats=not args.disable_log_stats,
        start_engine_loop=True,
        usage_context=usage,
    )


def session_params(
    authkey: bytes, tenant: str, session_id: str, state_version: int | None = None
) -> dict[str, Any]:
    """`SamplingParams(extra_args=session_params(...))`: what the connector reads per request
    (`dss.wire.SessionTag`, the one place that builds it), signed with the store's RPC authkey."""
    return SessionTag(TenantId(tenant), session_id, state_version).extra_args(tag_key(authkey))
