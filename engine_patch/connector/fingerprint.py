"""The model fingerprint of a running vLLM engine: what makes its KV pages' bytes meaningful.

Both halves of the connector (scheduler process and worker process) build it from the same
`VllmConfig` + `KVCacheConfig`, so they agree on the id without talking to each other. The worker
also checks it against the real KV tensors before it copies anything (`check_layer_tensors`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dss.namespace import FP8_KV_CACHE_DTYPES, LATENT_KV_LAYOUT, LATENT_ROWS_ISA, ModelFingerprint
from engine_patch.connector.groups import KVGroups, UnsupportedGroups
from engine_patch.connector.layouts import CANONICAL_FORMAT

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# The file `dss model pull` writes into a prepared model's folder (engine_patch.setup.model): its
# content identifies the weights, so it is the model's revision here.
READY_MARKER = ".dss-ready"
_SAMPLE_BYTES = 1 << 16
_SAMPLES_PER_FILE = 16


class UnsupportedKVCache(ValueError):
    """The engine's KV cache cannot be described by one `ModelFingerprint` (the connector turns off)."""


class GroupsKnownInEngine(UnsupportedKVCache):
    """The fingerprint depends on the KV cache groups vLLM's hybrid manager forms from the
    model's layers (a sliding-window model), which only the engine knows: the API process takes
    the fingerprint the engine's connector registered instead."""


def uncached_reason(vllm_config: VllmConfig) -> str | None:
    """Why DSS cannot cache this engine (one phrase), or None when it can.

    Decided in the API process from the engine's config before the engine starts, so that a
    server refuses to start (or says "caching off" in /readyz and /metrics) instead of serving as
    plain vLLM after the connector turned itself off inside the engine, where no one looks. The
    connector still checks the real KV cache in the engine (`build_fingerprint`) and fails the
    engine's start when this prediction was wrong and uncached serving was not allowed.
    """
    model_cfg = vllm_config.model_config
    if getattr(model_cfg, "is_attention_free", False):
        return "an attention-free model has no KV cache to store"
    if getattr(model_cfg, "is_hybrid", False):
        # Attention plus state-space layers: the mamba groups hold a recurrent state per request,
        # not KV per position (see engine_patch.connector.groups).
        return "a hybrid attention/state-space model: DSS does not store state-space (mamba) layer state"
    if getattr(model_cfg, "is_encoder_decoder", False):
        return "encoder-decoder models (cross-attention KV) are not supported"
    if getattr(model_cfg, "use_mla", False) and (why := _mla_reason(vllm_config)):
        return why
    try:
        frontend_fingerprint(vllm_config)
    except GroupsKnownInEngine:
        return None  # a sliding-window model: cached, its fingerprint comes from the engine
    except UnsupportedKVCache as exc:
        return str(exc)
    return None


def build_fingerprint(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, groups: KVGroups | None = None
) -> ModelFingerprint:
    """The fingerprint of the engine's real KV cache. Every group must be attention with one
    page geometry (a page is one block of every layer); `groups` (default: read from
    `kv_cache_config`) says which layers each group holds and its window."""
    kv_cache_dtype_of(vllm_config)
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    if not specs:
        raise UnsupportedKVCache("no KV cache groups")
    if groups is None:
        from vllm.model_executor.models.utils import extract_layer_index

        try:
            groups = KVGroups.of(kv_cache_config, extract_layer_index)
        except UnsupportedGroups as exc:
            raise UnsupportedKVCache(str(exc)) from None
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    attention = [s for s in specs if isinstance(s, AttentionSpec)]
    if len(attention) != len(specs):
        kinds = sorted({type(s).__name__ for s in specs if not isinstance(s, AttentionSpec)})
        raise UnsupportedKVCache(f"KV cache spec {', '.join(kinds)} is not an attention spec")
    spec = attention[0]
    latent = isinstance(spec, MLAAttentionSpec)
    if latent and (why := _mla_reason(vllm_config)):
        raise UnsupportedKVCache(why)
    if groups.hybrid and (latent or int(vllm_config.parallel_config.pipeline_parallel_size) > 1):
        # The scheduler's KV cache config names the first pipeline stage's layers only, so the
        # groups of the other stages' layers are not known where pages are planned.
        raise UnsupportedKVCache(
            "several KV cache groups (a sliding-window model) with pipeline parallelism or MLA "
            "are not supported"
        )
    for s in attention:
        if not latent and s.head_size_v != s.head_size:
            raise UnsupportedKVCache(f"K head size {s.head_size} != V head size {s.head_size_v}")
        if s.page_size_padded or s.num_head_slots is not None or s.state_content_bytes is not None:
            raise UnsupportedKVCache("padded or repacked KV pages are not supported")
        if (s.num_kv_heads, s.head_size, s.dtype, s.block_size) != (
            spec.num_kv_heads,
            spec.head_size,
            spec.dtype,
            spec.block_size,
        ):
            raise UnsupportedKVCache("KV cache groups differ in heads, head size, dtype or block size")
    return _make(
        vllm_config,
        # The scheduler's KV cache config is the first pipeline stage's: it names that stage's
        # layers only, so a pipeline-parallel page counts the model's layers instead.
        num_layers=_total_layers(vllm_config) or sum(len(g.layers) for g in groups.groups),
        num_kv_heads=int(spec.num_kv_heads),
        head_size=int(spec.head_size),
        dtype=spec.dtype,
        block_size=int(spec.block_size),
        layout=LATENT_KV_LAYOUT if latent else _layout_name(vllm_config, kv_cache_config),
        kv_groups=groups.describe(),
    )


def frontend_fingerprint(vllm_config: VllmConfig) -> ModelFingerprint:
    """The same fingerprint, computed in the API process from the config alone (before the engine
    core has sized its KV cache); `build_fingerprint` in the engine must agree, and a test checks it."""
    model_cfg, parallel = vllm_config.model_config, vllm_config.parallel_config
    kv_cache_dtype_of(vllm_config)
    hybrid_manager = not getattr(vllm_config.scheduler_config, "disable_hybrid_kv_cache_manager", True)
    if hybrid_manager and model_cfg.get_sliding_window() is not None:
        if int(parallel.pipeline_parallel_size) > 1:
            raise UnsupportedKVCache(
                "a sliding-window model's KV cache groups with pipeline parallelism are not supported"
            )
        raise GroupsKnownInEngine("the KV cache groups of a sliding-window model are formed in the engine")
    block_size = vllm_config.cache_config.block_size
    if block_size is None:
        raise UnsupportedKVCache("the block size is not resolved yet")
    if not isinstance(model_cfg.dtype, torch.dtype):
        raise UnsupportedKVCache(f"the model dtype {model_cfg.dtype!r} is not resolved yet")
    return _make(
        vllm_config,
        num_layers=_total_layers(vllm_config) or model_cfg.get_num_layers(parallel),
        num_kv_heads=model_cfg.get_num_kv_heads(parallel),  # 1 for MLA: one latent vector per token
        head_size=model_cfg.get_head_size(),  # for MLA: kv_lora_rank + qk_rope_head_dim
        dtype=_kv_tensor_dtype(vllm_config, model_cfg.dtype),
        block_size=int(block_size),
        layout=LATENT_KV_LAYOUT if model_cfg.use_mla else _layout_name(vllm_config, None),
    )


def _total_layers(vllm_config: VllmConfig) -> int | None:
    """The model's layer count for a pipeline-parallel engine (each stage sees its own); None for
    a single stage, whose fingerprint keeps counting the layers its KV cache config names."""
    if int(vllm_config.parallel_config.pipeline_parallel_size) == 1:
        return None
    return int(vllm_config.model_config.get_total_num_hidden_layers())


def kv_cache_dtype_of(vllm_config: VllmConfig) -> str:
    """The engine's KV cache dtype as the fingerprint names it: "auto", or an fp8 format of
    `FP8_KV_CACHE_DTYPES` (vLLM's "fp8" is its e4m3: the same bytes, so the same pages).
    `UnsupportedKVCache` for the others (per-token-head scales, Intel's fp8, DeepSeek's MLA fp8),
    and for fp8 with scales the engine computes from its first batch (`calculate_kv_scales`):
    each engine would quantize with its own, so its pages would not read back on another."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    name = "fp8_e4m3" if cache_dtype == "fp8" else cache_dtype
    if name == "auto":
        return name
    if name not in FP8_KV_CACHE_DTYPES:
        known = ", ".join(("auto", "fp8", *FP8_KV_CACHE_DTYPES))
        raise UnsupportedKVCache(f"KV cache dtype {cache_dtype!r} is not supported ({known} are)")
    if getattr(vllm_config.cache_config, "calculate_kv_scales", False):
        raise UnsupportedKVCache(
            f"KV cache dtype {cache_dtype!r} with scales computed at run time (calculate_kv_scales) "
            "is not supported: each engine's pages would be quantized with its own scales"
        )
    return name


def _kv_tensor_dtype(vllm_config: VllmConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the engine's KV tensors: the model's, or raw bytes for an fp8 cache."""
    return model_dtype if kv_cache_dtype_of(vllm_config) == "auto" else torch.uint8


def _mla_reason(vllm_config: VllmConfig) -> str | None:
    """Why DSS cannot cache this MLA engine, or None. Verified: vLLM's reference CPU MLA backend
    (`CPU_MLA`), whose cache is `[num_blocks, block_size, kv_lora_rank + rope dim]` of plain
    rows. Its AMX backend (CPUs with AMX tiles) and the CUDA MLA backends lay blocks out in their
    own ways (tiles, padding, fp8 scales) that DSS has not been tested with."""
    from vllm.platforms import current_platform

    if vllm_config.cache_config.cache_dtype != "auto":  # an MLA cache in fp8 has its own block format
        return f"MLA with KV cache dtype {vllm_config.cache_config.cache_dtype!r} is not supported"
    if not current_platform.is_cpu():
        return (
            "MLA (latent) KV caches are supported on vLLM's CPU backend only (GPU MLA layouts are untested)"
        )
    if _cpu_mla_backend(vllm_config) != "CPU_MLA":
        return "MLA on CPUs with AMX (vLLM's AMX_MLA backend packs blocks in tiles) is not supported"
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    latent, sizes = vllm_config.model_config.get_head_size(), CPUMLABackend.get_supported_head_sizes()
    if latent not in sizes:
        # vLLM would fail in the engine; said here in one line, before any engine process starts.
        return (
            f"MLA latent size {latent} (kv_lora_rank + qk_rope_head_dim): "
            f"vLLM's CPU MLA backend runs {sizes} only"
        )
    return None


def _cpu_mla_backend(vllm_config: VllmConfig) -> str:
    """The MLA backend vLLM's CPU platform picks (`CpuPlatform.get_attn_backend_cls`)."""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    amx = torch.cpu._is_amx_tile_supported()
    return "AMX_MLA" if amx and getattr(backend, "name", None) != "CPU_MLA" else "CPU_MLA"


def registered_for_model(
    vllm_config: VllmConfig, registered: Sequence[ModelFingerprint]
) -> list[ModelFingerprint]:
    """Of the fingerprints a store knows, those an engine of this config registered with KV cache
    groups (same model, revision, KV dtype and format): how the API process finds a sliding-window
    model's fingerprint (`GroupsKnownInEngine`)."""
    model_cfg = vllm_config.model_config
    model_id = Path(str(model_cfg.model)).name or str(model_cfg.model)
    revision = model_revision(str(model_cfg.model), model_cfg.revision)
    cache_dtype = kv_cache_dtype_of(vllm_config)
    dtype = (
        dtype_name(_kv_tensor_dtype(vllm_config, model_cfg.dtype))
        if isinstance(model_cfg.dtype, torch.dtype)
        else None
    )
    wanted = (model_id, revision, dtype, cache_dtype)
    return [
        fp
        for fp in registered
        if fp.kv_groups and (fp.model_id, fp.revision, fp.dtype, fp.kv_cache_dtype) == wanted
    ]


def _make(
    vllm_config: VllmConfig,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    block_size: int,
    layout: str,
    kv_groups: str = "",
) -> ModelFingerprint:
    """`dtype`: the KV tensors' (uint8 for an fp8 cache); the kernel's packing follows the
    model's dtype, as vLLM picks it (`CPUAttentionMetadataBuilder`)."""
    model_cfg, parallel = vllm_config.model_config, vllm_config.parallel_config
    model_dtype = model_cfg.dtype if isinstance(model_cfg.dtype, torch.dtype) else dtype
    return ModelFingerprint(
        model_id=Path(str(model_cfg.model)).name or str(model_cfg.model),
        revision=model_revision(str(model_cfg.model), model_cfg.revision),
        dtype=dtype_name(dtype),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
        kv_layout=layout,
        isa=attention_isa(vllm_config, model_dtype, block_size, head_size),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        kv_groups=kv_groups,
        kv_cache_dtype=kv_cache_dtype_of(vllm_config),
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _packed_cpu_blocks(vllm_config: VllmConfig) -> bool:
    """Whether the engine's KV blocks are packed by the CPU attention backend (CPU_ATTN, every
    non-MLA model on CPU): their interior is laid out for the kernel's ISA, not as plain values.
    Every other cache holds plain values in vLLM's `[B, H, N, C]` view (CUDA backends in any
    `KVCacheLayout`, and MLA's latent cache on CPU too)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu()) and not getattr(vllm_config.model_config, "use_mla", False)


def _layout_name(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str:
    """The layout of the bytes in a page. Packed CPU blocks are stored as they are: the engine's
    resolved `KVCacheLayout` (LBHNC, the only one the CPU backend takes). Anything else is stored
    in the canonical form (`engine_patch.connector.layouts`), whatever the engine's physical layout is, so
    engines that differ only in layout (FlashAttention's NHD, FlashInfer's HND, ...) share pages."""
    if not _packed_cpu_blocks(vllm_config):
        return CANONICAL_FORMAT
    layout = getattr(kv_cache_config, "kv_cache_layout", None)
    if not layout:
        try:
            layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        except ValueError:
            layout = "LBHNC"  # not resolved yet (the API process): the CPU backend's only layout
    return str(getattr(layout, "name", layout))


def attention_isa(vllm_config: VllmConfig, dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """What decides the packing inside a block: the CPU kernel's ISA (amx and vec pack K
    differently, so packed pages move only between engines with the same ISA), or "none" for
    pages in the canonical form, which hold plain values that any engine of the model can read
    (CUDA engines whatever their backend or device generation, MLA on CPU). On other platforms
    the device type, which keeps their pages apart until their layouts are known."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and vllm_config.model_config.use_mla:
        return LATENT_ROWS_ISA  # CPU_MLA (the only MLA backend accepted, `_mla_reason`)
    if _packed_cpu_blocks(vllm_config):
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return f"cpu-{_get_attn_isa(dtype, block_size, head_size, vllm_config.cache_config.cache_dtype)}"
    if current_platform.is_cpu() or current_platform.is_cuda_alike():
        return "none"
    return str(current_platform.device_type)


def model_revision(model: str, hub_revision: str | None = None) -> str:
    """A content identity of a model folder, cheap enough to compute at every engine start.

    A folder prepared by `engine_patch.setup.model` carries its checksums in the ready marker. Any
    other local folder is identified by its config.json plus, for each weight file, its size and
    sampled byte ranges: a fine-tune of the same architecture differs in the samples, and hashing
    gigabytes at every start would not be acceptable.
    """
    path = Path(model)
    if not path.is_dir():
        return f"hub:{hub_revision or 'main'}"
    h = hashlib.blake2b(digest_size=12)
    marker = path / READY_MARKER
    if marker.is_file():
        h.update(b"marker\x00" + marker.read_bytes())
        return h.hexdigest()
    config = path / "config.json"
    if config.is_file():
        h.update(b"config\x00" + json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    for weights in sorted([*path.glob("*.safetensors"), *path.glob("*.bin")]):
        _hash_samples(h, weights)
    return h.hexdigest()


def _hash_samples(h: Any, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\x00{size}\x00".encode())
    with path.open("rb") as f:
        if size <= _SAMPLE_BYTES * _SAMPLES_PER_FILE:
            h.update(f.read())
            return
        step = (size - _SAMPLE_BYTES) // (_SAMPLES_PER_FILE - 1)
        for i in range(_SAMPLES_PER_FILE):
            f.seek(i * step)
            h.update(f.read(_SAMPLE_BYTES))


def check_layer_tensors(fp: ModelFingerprint, layers: dict[int, torch.Tensor], num_blocks: int) -> None:
    """Raise `UnsupportedKVCache` unless this rank's layers (by model layer index) are the whole
    model (a single pipeline stage) or a part of it, and each holds `num_blocks` blocks of
    exactly `fp.layer_block_nbytes` bytes, in the fingerprint's dtype."""
    if fp.pp_size == 1 and len(layers) != fp.num_layers:
        raise UnsupportedKVCache(f"{len(layers)} KV layers, fingerprint says {fp.num_layers}")
    if not layers or any(not 0 <= i < fp.num_layers for i in layers):
        raise UnsupportedKVCache(f"KV layers {sorted(layers)} are not within the model's {fp.num_layers}")
    for i, kv in layers.items():
        if kv.shape[0] != num_blocks:
            raise UnsupportedKVCache(f"layer {i}: dim 0 is {kv.shape[0]}, expected {num_blocks} blocks")
        if dtype_name(kv.dtype) != fp.dtype:
            raise UnsupportedKVCache(f"layer {i}: dtype {kv.dtype}, fingerprint says {fp.dtype}")
        block_nbytes = kv[0].numel() * kv.element_size()
        if block_nbytes != fp.layer_block_nbytes:
            raise UnsupportedKVCache(
                f"layer {i}: {block_nbytes} bytes per block, fingerprint says {fp.layer_block_nbytes}"
            )
