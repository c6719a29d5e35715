"""Never silently off: an engine DSS cannot cache refuses to start (or, when the operator allows
it, says so in /readyz and /metrics) instead of serving as plain vLLM with one log line.

Before: more than one KV cache group (and, until parallel engines were cached, TP x PP != 1) turned
the connector off inside the engine and the server started as if all was well.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.api.cli.test_readyz import serve
from tests.api_server import model_dir

# Tiny configs of model kinds DSS refuses (config.json + tokenizer + a stand-in weights file: the
# refusal comes from the config alone, before any weights load or engine process starts).
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "jamba": ("hybrid attention/state-space", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "attn_layer_period": 2, "attn_layer_offset": 1,
        "expert_layer_period": 2, "num_experts": 1,
    }),
    "deepseek_v2": ("MLA", {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
        "v_head_dim": 32, "max_position_embeddings": 8192,
    }),
    "mamba": ("attention-free", {"hidden_size": 64, "num_hidden_layers": 2}),
}  # fmt: skip


def _default_model() -> Path:
    found = model_dir()
    if found is None:
        pytest.skip("no prepared model (DSS_MODEL_DIR or `dss model pull`)")
    return found


def tiny_config_model(root: Path, kind: str) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    src = _default_model()
    out = root / f"tiny-{kind}"
    AutoConfig.for_model(kind, vocab_size=49152, **TINY[kind][1]).save_pretrained(out)
    save_file({"unused": torch.zeros(1)}, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    return out


def engine_config(model: Path) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=512, enforce_eager=True).create_engine_config()


@pytest.fixture(scope="module")
def default_config() -> Any:
    return engine_config(_default_model())


def test_the_default_model_is_cached_in_every_parallel_layout(default_config: Any) -> None:
    from engine_patch.connector.fingerprint import frontend_fingerprint, uncached_reason

    assert uncached_reason(default_config) is None
    single = frontend_fingerprint(default_config)
    ids = {single.id}
    for tp, pp in ((3, 1), (1, 2), (3, 2)):
        config = _with_layout(default_config, tp, pp)
        assert uncached_reason(config) is None
        fp = frontend_fingerprint(config)
        # Pages are per layout: each rank holds 3 / tp KV heads, the page all of the layers.
        assert (fp.tp_size, fp.pp_size, fp.num_kv_heads) == (tp, pp, 3 // tp)
        assert fp.num_layers == single.num_layers and fp.page_nbytes == single.page_nbytes
        ids.add(fp.id)
    assert len(ids) == 4


def test_fp8_kv_caches_are_cached_with_their_format_in_the_fingerprint(default_config: Any) -> None:
    """fp8 KV (vLLM's CPU build runs it with AVX-512 or AMX): one byte per value, the format part of
    the id ("fp8" is e4m3: the same pages), the kernel's packing from the model's dtype as vLLM
    picks it. Scales computed at run time and fp8 formats other than vLLM's two are refused by
    name. Before: every KV cache dtype but "auto" was refused."""
    import torch

    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        # vLLM's CPU attention raises NotImplementedError on reading the layout (an AVX2-only
        # AMD EPYC, 2026-12-05); tests/engine_patch/connector/test_model_matrix.py skips alike.
        pytest.skip("vLLM's CPU build runs fp8 KV caches only with AVX-512 or AMX")
    from engine_patch.connector.fingerprint import frontend_fingerprint, uncached_reason

    def with_cache(cache_dtype: str, calculate_kv_scales: bool = False) -> Any:
        cache = copy.copy(default_config.cache_config)
        cache.cache_dtype, cache.calculate_kv_scales = cache_dtype, calculate_kv_scales
        return SimpleNamespace(**{**vars(_with_layout(default_config, 1, 1)), "cache_config": cache})

    auto = frontend_fingerprint(default_config)
    assert auto.kv_cache_dtype == "auto" and auto.id == frontend_fingerprint(with_cache("auto")).id
    fps = {name: frontend_fingerprint(with_cache(name)) for name in ("fp8", "fp8_e4m3", "fp8_e5m2")}
    for name, fp in fps.items():
        assert uncached_reason(with_cache(name)) is None
        assert (fp.dtype, fp.dtype_bytes, fp.isa) == ("uint8", 1, auto.isa), name
        assert fp.page_nbytes * 2 == auto.page_nbytes
    assert fps["fp8"] == fps["fp8_e4m3"] and fps["fp8_e4m3"].kv_cache_dtype == "fp8_e4m3"
    assert len({auto.id, fps["fp8_e4m3"].id, fps["fp8_e5m2"].id}) == 3
    assert uncached_reason(with_cache("fp8", calculate_kv_scales=True)) == (
        "KV cache dtype 'fp8' with scales computed at run time (calculate_kv_scales) is not supported: "
        "each engine's pages would be quantized with its own scales"
    )
    assert uncached_reason(with_cache("fp8_inc")) == (
        "KV cache dtype 'fp8_inc' is not supported (auto, fp8, fp8_e4m3, fp8_e5m2 are)"
    )


def _with_layout(config: Any, tp: int, pp: int) -> Any:
    """The parts of `config` the decision reads, with another parallel layout (building a real
    TP=3 config would check this machine's NUMA nodes and cores)."""
    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, rank=0)
    return SimpleNamespace(
        model_config=config.model_config,
        parallel_config=parallel,
        cache_config=config.cache_config,
        scheduler_config=config.scheduler_config,
    )


@pytest.mark.parametrize("kind", sorted(TINY))
def test_model_kinds_dss_cannot_cache_are_named(tmp_path: Path, kind: str) -> None:
    from engine_patch.connector.fingerprint import uncached_reason

    reason = uncached_reason(engine_config(tiny_config_model(tmp_path, kind)))
    assert reason is not None and TINY[kind][0] in reason


def test_the_connector_fails_the_engine_unless_uncached_serving_is_allowed(default_config: Any) -> None:
    # The backstop inside the engine, for what the API process did not predict: before, it logged
    # one line and stayed off.
    from engine_patch.connector.dss_connector import DSSConnector
    from engine_patch.connector.fingerprint import UnsupportedKVCache

    # Two groups of a kind DSS does not store (what a hybrid attention/state-space model has).
    two_groups = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(kv_cache_spec=object(), layer_names=[f"model.layers.{i}.attn"]) for i in (0, 1)
        ]
    )
    with pytest.raises(UnsupportedKVCache, match="DSS_ENGINE__ALLOW_UNCACHED"):
        DSSConnector._fingerprint(default_config, two_groups, False)  # type: ignore[arg-type]
    assert DSSConnector._fingerprint(default_config, two_groups, True) is None  # type: ignore[arg-type]


@pytest.mark.timeout(180)
def test_serve_refuses_a_model_it_cannot_cache_with_one_line(tmp_path: Path) -> None:
    model = tiny_config_model(tmp_path, "deepseek_v2")
    # The reference CPU MLA backend on every CPU (vLLM picks its AMX one where AMX tiles exist,
    # which DSS refuses for another reason: the latent size is what this test is about).
    args = ("--model", str(model), "--log-level", "warning", "--engine-arg", "attention_backend=CPU_MLA")
    proc, _ = serve(tmp_path / "data", *args)
    _, err = proc.communicate(timeout=150)
    assert proc.returncode == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "cannot start:" in line]
    assert len(lines) == 1, err
    # (DeepSeek's own latent size, 576, is cached: tests/engine_patch/connector/test_model_matrix.py)
    assert "DSS cannot cache model tiny-deepseek_v2: MLA latent size 48" in lines[0], err
    assert "DSS_ENGINE__ALLOW_UNCACHED=true" in lines[0], err


def test_a_worker_whose_kv_cache_does_not_match_fails_the_engine_unless_uncached_is_allowed() -> None:
    # Before: the worker logged "DSS connector off in this worker" and the engine served uncached.
    import torch

    from engine_patch.connector.fingerprint import UnsupportedKVCache
    from engine_patch.connector.worker_side import WorkerSide
    from tests.store_helpers import SMALL_FP

    wrong = {f"model.layers.{i}.self_attn.attn": torch.zeros(8, 1, 2, 2) for i in range(SMALL_FP.num_layers)}

    def index(name: str) -> int:
        return int(name.split(".")[2])

    strict = WorkerSide(SMALL_FP, None, 8)
    with pytest.raises(UnsupportedKVCache, match="DSS_ENGINE__ALLOW_UNCACHED"):
        strict.register_kv_caches(wrong, index)
    lenient = WorkerSide(SMALL_FP, None, 8, allow_uncached=True)
    lenient.register_kv_caches(wrong, index)
    assert lenient.disabled and not lenient.ready
