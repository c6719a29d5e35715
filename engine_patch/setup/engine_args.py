"""vLLM engine arguments an operator passes through `dss serve`, and the CPU thread binding of
parallel engines.

- `parse_engine_arg("NAME=VALUE")`: one `--engine-arg`; the value is JSON when it parses as JSON
  (`true`, `8`, `{"a": 1}`), else the string as written.
- `check_engine_args(args)`: the names normalised (`max-num-seqs` and `max_num_seqs` are one name)
  and checked against vLLM's own `AsyncEngineArgs` fields: an unknown name, or one DSS sets itself
  (the model, the connector, the settings with a flag of their own), raises `EngineArgumentError`
  with one line, never ignored.
- `cpu_threads_bind(cpus, ranks)`: vLLM's `VLLM_CPU_OMP_THREADS_BIND` value giving each rank of a
  parallel engine its own contiguous share of `cpus` ("0|1", "0-3|4-7"); `check_parallel_layout`
  decides whether a parallel engine on CPU can start and which binding it gets.

Importing this module imports neither vLLM nor torch, nor does checking names: the CLI refuses
bad input with it at once, before anything loads. `check_parallel_layout` imports vLLM's
platform (quietly) to know whether the engine runs on CPU.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dss.errors import DSSError

THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"

# Engine arguments DSS sets itself, with what sets them instead. Passing one through would
# either break DSS (the connector, the model it resolved) or give one setting two homes.
OWNED_BY_DSS: dict[str, str] = {
    "model": "--model / DSS_ENGINE__MODEL",
    "kv_transfer_config": "DSS's own KV connector (it is not replaceable)",
    "served_model_name": "DSS_ENGINE__SERVED_MODEL_NAME",
    "dtype": "DSS_ENGINE__DTYPE",
    "seed": "DSS_ENGINE__SEED",
    "enforce_eager": "DSS_ENGINE__ENFORCE_EAGER",
    "max_num_seqs": "DSS_ENGINE__MAX_NUM_SEQS",
    "tensor_parallel_size": "--tensor-parallel-size / DSS_ENGINE__TENSOR_PARALLEL_SIZE",
    "pipeline_parallel_size": "--pipeline-parallel-size / DSS_ENGINE__PIPELINE_PARALLEL_SIZE",
    "kv_cache_dtype": "--kv-cache-dtype / DSS_ENGINE__KV_CACHE_DTYPE",
    "block_size": "--block-size / DSS_ENGINE__BLOCK_SIZE",
    "max_model_len": "--max-model-len / DSS_ENGINE__MAX_MODEL_LEN",
}


class EngineArgumentError(DSSError):
    """A vLLM engine argument or parallel layout DSS cannot start with; the message is one line
    that names the argument and what to do."""


def normalize_name(name: str) -> str:
    """vLLM's CLI spelling (`--max-num-seqs`) and its Python one (`max_num_seqs`) are one name."""
    return name.strip().removeprefix("--").replace("-", "_")


def parse_engine_arg(text: str) -> tuple[str, Any]:
    """`NAME=VALUE` -> (name, value); the value is JSON when it parses, else the text itself."""
    name, sep, raw = text.partition("=")
    if not sep or not name.strip():
        raise EngineArgumentError(
            f"--engine-arg {text!r}: expected NAME=VALUE, e.g. max_num_batched_tokens=8192"
        )
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return normalize_name(name), value


@functools.cache
def vllm_engine_arg_names() -> frozenset[str]:
    """The fields of vLLM's `AsyncEngineArgs` (what `vllm serve` accepts as engine arguments).

    Read from the source of `vllm.engine.arg_utils` (the annotated fields of `EngineArgs` and
    `AsyncEngineArgs`), not by importing it: the import takes seconds to tens of seconds and logs
    vLLM's start-up warnings on stderr, in front of a refusal that must be one line.
    tests/api/cli/test_serve_flags.py checks that this equals `dataclasses.fields(AsyncEngineArgs)`."""
    spec = importlib.util.find_spec("vllm")  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise EngineArgumentError("vLLM is not installed: engine arguments cannot be checked")
    source = Path(next(iter(spec.submodule_search_locations))) / "engine" / "arg_utils.py"
    names: set[str] = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name in ("EngineArgs", "AsyncEngineArgs"):
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and not stmt.target.id.startswith("_")
                    and "ClassVar" not in ast.unparse(stmt.annotation)
                ):
                    names.add(stmt.target.id)
    return frozenset(names)


def check_engine_args(args: Mapping[str, Any], known: Iterable[str] | None = None) -> dict[str, Any]:
    """`args` with normalised names, or `EngineArgumentError` for the first name that is not a
    vLLM engine argument (`known`, default: `vllm_engine_arg_names()`) or that DSS sets itself."""
    out: dict[str, Any] = {}
    names: frozenset[str] | None = frozenset(known) if known is not None else None
    for raw_name, value in args.items():
        name = normalize_name(raw_name)
        if name in OWNED_BY_DSS:
            raise EngineArgumentError(f"engine argument {raw_name!r} is set by DSS: use {OWNED_BY_DSS[name]}")
        if names is None:
            names = vllm_engine_arg_names()
        if name not in names:
            raise EngineArgumentError(
                f"unknown vLLM engine argument {raw_name!r} "
                "(not a field of vllm.engine.arg_utils.AsyncEngineArgs)"
            )
        out[name] = value
    return out


def cpu_threads_bind(cpus: Iterable[int], ranks: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `ranks` ranks sharing `cpus`: the sorted CPUs cut into
    `ranks` contiguous runs as equal as can be (the first ones get one more), one per rank, in
    vLLM's syntax (`|` between ranks, `a-b` ranges, `,` between ranges): "0|1", "0-3|4-7".
    Fewer CPUs than ranks raises `EngineArgumentError`: two ranks on one CPU would each run
    OpenMP threads bound to it and crawl."""
    ids = sorted(set(cpus))
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, not {ranks}")
    if len(ids) < ranks:
        raise EngineArgumentError(
            f"a parallel engine of {ranks} ranks needs at least {ranks} CPUs, this process may use "
            f"{len(ids)} ({_ranges(ids)}); lower --tensor-parallel-size/--pipeline-parallel-size or set "
            f"{THREADS_BIND_ENV} yourself"
        )
    share, extra = divmod(len(ids), ranks)
    parts, start = [], 0
    for rank in range(ranks):
        end = start + share + (1 if rank < extra else 0)
        parts.append(_ranges(ids[start:end]))
        start = end
    return "|".join(parts)


def check_parallel_layout(
    tensor: int, pipeline: int, enforce_eager: bool, set_by_dss: str | None = None
) -> str | None:
    """What a parallel engine on the CPU platform needs, checked before any engine process starts.

    Returns the `VLLM_CPU_OMP_THREADS_BIND` to set when the operator set none: this process's CPUs
    (`os.sched_getaffinity`) split into one contiguous range per rank. vLLM's own `auto` binds one
    rank per NUMA node and refuses more ranks than nodes ("Not enough allowed NUMA nodes"), which
    is every parallel engine on a one-node machine. None: nothing to set (one rank, a GPU
    platform, or the operator's own value: a value other than `set_by_dss`, what this process
    set for an earlier engine). Raises `EngineArgumentError` (one line) for fewer CPUs
    than ranks, and for pipeline parallelism in eager mode, where vLLM's CPU build dies on the
    first request (docs/models.md, "Why PP=2 fails in eager mode")."""
    from vllm.platforms import current_platform  # quiet, unlike vllm.engine.arg_utils

    ranks = tensor * pipeline
    if ranks == 1 or not current_platform.is_cpu():
        return None
    if pipeline > 1 and enforce_eager:
        raise EngineArgumentError(
            f"pipeline parallel size {pipeline} on vLLM's CPU build needs DSS_ENGINE__ENFORCE_EAGER=false: "
            "in eager mode its last stage has no buffer for the previous stage's output and the engine "
            "dies on the first request (docs/models.md)"
        )
    current = os.environ.get(THREADS_BIND_ENV)
    if current is not None and current != set_by_dss:
        return None
    return cpu_threads_bind(os.sched_getaffinity(0), ranks)


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (vLLM's `parse_id_list` syntax)."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
