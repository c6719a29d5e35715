"""Build vLLM engines wired to a DSS store: `LLM` for scripts and tests, `AsyncLLM` for the server.

The store lives in the calling process (it owns the data directory); the engine's processes reach
it through the store's local RPC address and authkey, passed in the connector's extra config.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dss.types import SessionId, TenantId
from dss.wire import SessionTag, tag_key
from engine_patch.connector.dss_connector import CONNECTOR_MODULE, CONNECTOR_NAME
from engine_patch.setup.engine_args import THREADS_BIND_ENV, check_engine_args, check_parallel_layout

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

log = logging.getLogger("dss.engine")


@functools.cache
def native_bf16() -> bool:
    """Whether this machine computes bfloat16 natively: a CUDA device, or a CPU with AVX512-BF16
    or AMX. A CPU with AVX2 only (some AMD EPYC machines) emulates it."""
    import torch

    if torch.cuda.is_available():
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def served_dtype() -> str:
    """The dtype served when the operator names none (`DSS_ENGINE__DTYPE`). bfloat16 where it is
    native: every model's usual dtype, and on CPUs with AMX float32 served later turns 2.9x slower
    and collapsed bench/api_load.py from 16.5 to 0.8 requests/s. float32 on a CPU that only
    emulates bfloat16 (AVX2): there bfloat16 is the slow one (the test suite ran about 3x longer).
    The tiny default model answers a few near-tie questions differently in bf16; `dss model pull`
    verifies in the served dtype. Numbers: docs/operations.md, "Served dtype"."""
    return "bfloat16" if native_bf16() else "float32"


@dataclass(frozen=True, slots=True)
class EngineSettings:
    model: Path
    max_model_len: int = 4096
    kv_cache_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU (vLLM reads whole GiB)
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    block_size: int | None = None  # platform default (128 on CPU)
    num_gpu_blocks_override: int | None = None
    # `served_dtype()`: bfloat16 where the hardware computes it natively, else float32.
    dtype: str = field(default_factory=served_dtype)
    # The parallel layout and KV cache dtype, under vLLM's own names (`dss serve` flags).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
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
    # vLLM's KV events (ZMQ PUB on this endpoint, e.g. "tcp://*:5557"; None: off), with the
    # store's host and disk pages beside vLLM's own blocks (`engine_patch.connector.kv_events`).
    # llm-d wants the topic `kv@<pod-ip:port>@<model>` (docs/operations.md, "KV events").
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_poll_s: float = 0.1  # how often the scheduler reads the store's page events
    # Any other vLLM engine argument (`AsyncEngineArgs` field names; checked, never ignored).
    extra_engine_args: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        """Engine ranks: tensor x pipeline parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


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
            "kv_events_poll_s": settings.kv_events_poll_s,
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
        "tensor_parallel_size": settings.tensor_parallel_size,
        "pipeline_parallel_size": settings.pipeline_parallel_size,
        "kv_cache_dtype": settings.kv_cache_dtype,
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
    kwargs.update(_parallel_on_cpu(settings))
    if settings.connector:
        if store_address is None or authkey is None:
            raise ValueError("the DSS connector needs the store's RPC address and authkey")
        kwargs["kv_transfer_config"] = kv_transfer_config(store_address, authkey, settings)
    if settings.kv_events_endpoint:
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=settings.kv_events_endpoint,
            topic=settings.kv_events_topic,
        )
    kwargs.update(check_engine_args(settings.extra_engine_args))
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


def _parallel_on_cpu(settings: EngineSettings) -> dict[str, Any]:
    """A parallel engine on the CPU platform runs its ranks in processes of vLLM's multiprocessing
    executor (`mp`; `uni` refuses pipeline parallelism, `ray` is not installed with vllm-cpu)."""
    from vllm.platforms import current_platform

    if settings.world_size == 1 or not current_platform.is_cpu():
        return {}
    return {"distributed_executor_backend": "mp"}


# The thread binding this process set itself (so that a later engine of another size recomputes
# it instead of taking it for the operator's).
_bind_set_by_dss: str | None = None


def _prepare_environment(settings: EngineSettings) -> None:
    global _bind_set_by_dss
    # Read by the engine processes vLLM spawns, which inherit the environment.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(settings.kv_cache_space_gib))
    tp, pp = settings.tensor_parallel_size, settings.pipeline_parallel_size
    bind = check_parallel_layout(tp, pp, settings.enforce_eager, set_by_dss=_bind_set_by_dss)
    if bind is not None:
        os.environ[THREADS_BIND_ENV] = _bind_set_by_dss = bind
        log.info("parallel engine on CPU: tensor %d x pipeline %d ranks, executor mp, %s=%r", tp, pp,
                 THREADS_BIND_ENV, bind)  # fmt: skip
    elif settings.world_size > 1 and THREADS_BIND_ENV in os.environ:
        log.info("parallel engine: tensor %d x pipeline %d ranks, %s=%r (the operator's)", tp, pp,
                 THREADS_BIND_ENV, os.environ[THREADS_BIND_ENV])  # fmt: skip
    # Out-of-tree connector modules are imported by name in every engine process.
    root = str(Path(__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH", "")
    if root not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, path) if p)


def build_llm(store_address: str | None, authkey: bytes | None, settings: EngineSettings) -> LLM:
    _prepare_environment(settings)
    from vllm import LLM

    try:
        return LLM(**engine_kwargs(store_address, authkey, settings))
    except BaseException:
        # With in-process workers (VLLM_ENABLE_V1_MULTIPROCESSING=0) vLLM keeps the worker's
        # connector in a process global that only a clean shutdown clears: after an engine that
        # failed to start, the next engine in this process would reuse that connector, with the
        # failed engine's fingerprint and block count.
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
        raise


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


def session_params(authkey: bytes, tenant: str, session_id: str) -> dict[str, Any]:
    """`SamplingParams(extra_args=session_params(...))`: what the connector reads per request
    (`dss.wire.SessionTag`, the one place that builds it), signed with the store's RPC authkey."""
    return SessionTag(TenantId(tenant), SessionId(session_id)).extra_args(tag_key(authkey))
