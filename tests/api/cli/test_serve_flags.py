"""`dss serve` takes vLLM's engine settings under vLLM's own names (issue 20, item 6).

- `--tensor-parallel-size`, `--pipeline-parallel-size`, `--kv-cache-dtype`, `--block-size`,
  `--max-model-len` (and their `DSS_ENGINE__*` variables) reach vLLM's engine configuration;
  `--engine-arg NAME=VALUE` and `DSS_ENGINE__EXTRA_ARGS` pass any other `AsyncEngineArgs` field,
  and an unknown name (or one DSS sets itself) refuses the start with one line and exit 2.
- A parallel engine on CPU gets one contiguous range of this process's CPUs per rank
  (`VLLM_CPU_OMP_THREADS_BIND`) and vLLM's `mp` executor, unless the operator bound it.
- The served dtype is `factory.served_dtype()` (bfloat16 where native) unless
  `DSS_ENGINE__DTYPE` says otherwise.

Most of it is checked on vLLM's resolved configuration (`create_engine_config`, no engine
process); one real `dss serve --max-model-len 2048 --block-size 32` shows the engine runs with them.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.settings import Settings, load_settings
from engine_patch.setup import factory
from engine_patch.setup.engine_args import (
    THREADS_BIND_ENV,
    EngineArgumentError,
    check_engine_args,
    check_parallel_layout,
    cpu_threads_bind,
    parse_engine_arg,
    vllm_engine_arg_names,
)
from tests import api_server
from tests.api_server import REPO, ApiServer, die_with_parent, model_dir

MODEL = model_dir()
needs_model = pytest.mark.skipif(MODEL is None, reason="the default model is not prepared (make model)")


@pytest.fixture
def engine_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No `DSS_ENGINE__*` nor thread binding from the caller's environment; the binding the
    factory sets during a test is removed after it."""
    for key in list(os.environ):
        if key.startswith("DSS_ENGINE__") or key == THREADS_BIND_ENV:
            monkeypatch.delenv(key)
    monkeypatch.setattr(factory, "_bind_set_by_dss", None)
    yield monkeypatch
    os.environ.pop(THREADS_BIND_ENV, None)


def vllm_config(settings: Settings) -> Any:
    """vLLM's resolved configuration of what `dss serve` would start, without starting it (the
    factory's path up to the engine: environment, arguments, `create_engine_config`)."""
    assert MODEL is not None
    es = settings.engine.engine_settings(MODEL)
    return factory.async_engine_args("127.0.0.1:1", b"k" * 32, es).create_engine_config()


# ---------------------------------------------------------------------------- pure functions
def test_engine_arg_values_are_json_when_they_parse() -> None:
    assert parse_engine_arg("max_num_batched_tokens=8192") == ("max_num_batched_tokens", 8192)
    assert parse_engine_arg("--enable-chunked-prefill=false") == ("enable_chunked_prefill", False)
    assert parse_engine_arg('hf_overrides={"rope_theta": 1e4}') == ("hf_overrides", {"rope_theta": 1e4})
    assert parse_engine_arg("kv_offloading_backend=native") == ("kv_offloading_backend", "native")
    assert parse_engine_arg("tokenizer_mode=") == ("tokenizer_mode", "")
    with pytest.raises(EngineArgumentError, match="expected NAME=VALUE"):
        parse_engine_arg("max_num_batched_tokens")


def test_engine_arg_names_are_vllms_own() -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs) if not f.name.startswith("_")}
    assert vllm_engine_arg_names() == fields  # read from vLLM's source, without importing it
    assert check_engine_args({"max-num-batched-tokens": 8192, "disable_log_stats": False}) == {
        "max_num_batched_tokens": 8192,
        "disable_log_stats": False,
    }
    with pytest.raises(EngineArgumentError) as err:
        check_engine_args({"max_num_batched_tokenz": 1})
    assert str(err.value) == (
        "unknown vLLM engine argument 'max_num_batched_tokenz' "
        "(not a field of vllm.engine.arg_utils.AsyncEngineArgs)"
    )
    for owned, where in [
        ("model", "--model"),
        ("kv-transfer-config", "connector"),
        ("block_size", "--block-size"),
    ]:
        with pytest.raises(EngineArgumentError, match=f"is set by DSS: use .*{where}"):
            check_engine_args({owned: 1})


def test_cpu_threads_bind_gives_each_rank_a_contiguous_range() -> None:
    assert cpu_threads_bind({0, 1}, 2) == "0|1"
    assert cpu_threads_bind(range(8), 2) == "0-3|4-7"
    assert cpu_threads_bind({0, 1, 2}, 2) == "0-1|2"
    assert cpu_threads_bind({0, 2, 4, 5}, 2) == "0,2|4-5"
    assert cpu_threads_bind(range(4, 10), 3) == "4-5|6-7|8-9"
    assert cpu_threads_bind({3}, 1) == "3"
    with pytest.raises(
        EngineArgumentError, match="2 ranks needs at least 2 CPUs, this process may use 1 \\(5\\)"
    ):
        cpu_threads_bind({5}, 2)


# ------------------------------------------------------------- settings -> vLLM configuration
@needs_model
def test_flags_and_variables_reach_vllms_configuration(engine_env: pytest.MonkeyPatch) -> None:
    engine_env.setenv("DSS_ENGINE__EXTRA_ARGS", '{"max_num_batched_tokens": 8192, "max-logprobs": 7}')
    # The default model has 9 attention heads and 3 KV heads: three ranks of three and one.
    engine_env.setenv("DSS_ENGINE__TENSOR_PARALLEL_SIZE", "3")
    settings = load_settings(engine={"block_size": 32, "max_model_len": 2048, "kv_cache_dtype": "auto"})
    engine_env.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    config = vllm_config(settings)
    assert config.parallel_config.tensor_parallel_size == 3
    assert config.parallel_config.pipeline_parallel_size == 1
    assert config.parallel_config.distributed_executor_backend == "mp"
    assert config.cache_config.block_size == 32 and config.cache_config.cache_dtype == "auto"
    assert config.model_config.max_model_len == 2048
    assert config.scheduler_config.max_num_batched_tokens == 8192  # the pass-through wins
    assert config.model_config.max_logprobs == 7
    assert str(config.model_config.dtype) == f"torch.{factory.served_dtype()}"  # the served default
    assert os.environ[THREADS_BIND_ENV] == "0|1|2"  # set by the factory, one CPU per rank


@needs_model
def test_one_rank_in_the_operators_dtype(engine_env: pytest.MonkeyPatch) -> None:
    engine_env.setenv("DSS_ENGINE__DTYPE", "float32")
    config = vllm_config(load_settings())
    assert str(config.model_config.dtype) == "torch.float32"
    assert config.parallel_config.world_size == 1
    assert config.cache_config.block_size == 128  # the CPU platform's default
    assert THREADS_BIND_ENV not in os.environ  # one rank: vLLM binds it itself


def test_parallel_layout_on_cpu(engine_env: pytest.MonkeyPatch) -> None:
    engine_env.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert check_parallel_layout(1, 1, True) is None
    assert check_parallel_layout(2, 1, True) == "0-1|2-3"
    assert check_parallel_layout(1, 2, False) == "0-1|2-3"
    with pytest.raises(EngineArgumentError, match="DSS_ENGINE__ENFORCE_EAGER=false"):
        check_parallel_layout(1, 2, True)  # vLLM's CPU build dies on the first request
    with pytest.raises(EngineArgumentError, match="needs at least 8 CPUs"):
        check_parallel_layout(8, 1, True)
    engine_env.setenv(THREADS_BIND_ENV, "0|2")  # the operator's binding is left alone
    assert check_parallel_layout(2, 1, True) is None


# ----------------------------------------------------------------------------------- dss serve
def serve(
    args: list[str], tmp_path: Path, env: dict[str, str] | None = None, cpus: set[int] | None = None
) -> Any:
    """`dss serve ARGS` that must refuse before it listens (port 9: nothing may answer there)."""

    def preexec() -> None:
        die_with_parent()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    full_env = {
        k: v for k, v in os.environ.items() if not k.startswith("DSS_ENGINE__") and k != THREADS_BIND_ENV
    }
    full_env.update(env or {})
    cmd = [
        sys.executable,
        "-m",
        "api.cli",
        "serve",
        "--data-dir",
        str(tmp_path / "data"),
        "--port",
        "9",
        *args,
    ]
    return subprocess.run(
        cmd,
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=preexec,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (
            ["--engine-arg", "max_num_seqz=4"],
            {},
            "dss serve: unknown vLLM engine argument 'max_num_seqz' "
            "(not a field of vllm.engine.arg_utils.AsyncEngineArgs)",
        ),
        (
            [],
            {"DSS_ENGINE__EXTRA_ARGS": '{"swap_space": 4}'},
            "dss serve: unknown vLLM engine argument 'swap_space' "
            "(not a field of vllm.engine.arg_utils.AsyncEngineArgs)",
        ),
        (
            ["--engine-arg", "dtype=float16"],
            {},
            "dss serve: engine argument 'dtype' is set by DSS: use DSS_ENGINE__DTYPE",
        ),
        (
            ["--engine-arg", "oops"],
            {},
            "dss serve: --engine-arg 'oops': expected NAME=VALUE, e.g. max_num_batched_tokens=8192",
        ),
    ],
)
def test_a_bad_engine_argument_refuses_in_one_line(
    args: list[str], env: dict[str, str], line: str, tmp_path: Path
) -> None:
    proc = serve(args, tmp_path, env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [line]
    assert not (tmp_path / "data").exists()  # refused before the store opened


@pytest.mark.slow
def test_more_ranks_than_cpus_refuse_in_one_line(tmp_path: Path) -> None:
    proc = serve(["--tensor-parallel-size", "2"], tmp_path, cpus={0})
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        "dss serve: a parallel engine of 2 ranks needs at least 2 CPUs, this process may use 1 (0)"
    )


@pytest.mark.engine
@pytest.mark.slow
@needs_model
def test_serve_runs_the_engine_with_vllm_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real start with `--max-model-len 2048 --block-size 32` and a pass-through argument: the
    engine answers (the README's example, right), its context is 2048 tokens, and the pages it
    stored are 32-token bf16 pages."""

    class FlaggedServer(ApiServer):
        def command(self) -> list[str]:
            flags = [
                "--max-model-len",
                "2048",
                "--block-size",
                "32",
                "--engine-arg",
                "max_num_batched_tokens=4096",
            ]
            return [*super().command(), *flags]

    # The flag wins over the variable. A 2-core machine shared with other engines took over 10
    # minutes to start this one: generous deadlines.
    env = {"DSS_ENGINE__MAX_MODEL_LEN": "4096", "DSS_ENGINE__STARTUP_TIMEOUT_S": "1800"}
    server = FlaggedServer(MODEL, tmp_path, env=env)
    monkeypatch.setattr(api_server, "START_TIMEOUT_S", 1800.0)
    server.start()
    try:
        ready = httpx.get(server.base_url + "/readyz", timeout=10).json()
        assert ready["kv_caching"] is True, ready
        with server.client("alice") as http:
            models = http.get("/v1/models").json()["data"]
            assert [m["max_model_len"] for m in models] == [2048]
            # The README's example, as it asks it: the default model answers it right in bf16.
            question = {"role": "user", "content": "What is the capital of Japan?"}
            body = {"session_id": "geo", "max_tokens": 16, "temperature": 0, "messages": [question]}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert "Tokyo" in r.json()["choices"][0]["message"]["content"], r.text
    finally:
        server.stop()  # uvicorn re-raises SIGTERM after its graceful shutdown: the code is -15
    from dss.config import StoreConfig
    from dss.store import Store

    store = Store.open(StoreConfig(data_dir=server.data_dir, fsync=False, codec_process=False))
    try:
        (fp,) = (store.fingerprints.get(f) for f in store.fingerprints)
        assert (fp.block_size, fp.dtype) == (32, factory.served_dtype())
    finally:
        store.close()


@needs_model
def test_kv_caching_off_serves_through_plain_vllm_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`DSS_ENGINE__KV_CACHING=false`: the engine runs without DSS's connector (the baseline of
    bench/cold_concurrent.py), announced as an uncached model is; sessions and versions as ever."""
    env = {"DSS_ENGINE__KV_CACHING": "false", "DSS_ENGINE__STARTUP_TIMEOUT_S": "1800"}
    server = ApiServer(MODEL, tmp_path, env=env)
    monkeypatch.setattr(api_server, "START_TIMEOUT_S", 1800.0)
    server.start()
    try:
        ready = httpx.get(server.base_url + "/readyz", timeout=10).json()
        assert ready["kv_caching"] is False and "DSS_ENGINE__KV_CACHING" in ready["uncached_reason"], ready
        with server.client("alice") as http:
            turn = [{"role": "user", "content": "Name three rivers."}]
            body = {"session_id": "off", "max_tokens": 8, "temperature": 0, "messages": turn}
            first = http.post("/v1/chat/completions", json=body).json()
            answer = first["choices"][0]["message"]
            again = {**body, "messages": [*turn, answer, {"role": "user", "content": "And lakes?"}]}
            second = http.post("/v1/chat/completions", json=again).json()
            assert (first["state_version"], second["parent_version"]) == (1, 1), second
            assert first["dss"]["loaded_tokens"] == second["dss"]["loaded_tokens"] == 0, second["dss"]
    finally:
        server.stop()
    from dss.config import StoreConfig
    from dss.store import Store

    store = Store.open(StoreConfig(data_dir=server.data_dir, fsync=False, codec_process=False))
    try:
        assert not list(store.fingerprints)  # no connector registered, nothing stored
    finally:
        store.close()
