"""A tensor-parallel engine (TP=2, two worker processes) caches and loads through DSS.

Each rank copies its own KV heads of every page; a turn served from the store must give the
same tokens as vLLM's own prefix cache holding the same blocks (the same KV bytes), and a tail
page saved by both ranks must load. A tiny random-weight Qwen2-style model (2 KV heads, one per
rank) is made at test time. Pipeline parallelism (PP=2) runs in `bench/model_matrix.py`: its
engine needs CUDA-graph-free compilation on CPU (docs/models.md) and starts too slowly here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dss.store import Store
from tests.engine_helpers import Engine, open_store
from tests.tiny_models import make_tiny_model

TINY = "qwen2-h64-gqa2"  # 2 KV heads: one per rank
PAGE = 128  # the CPU backend's default block size


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(100, 20000, size=n)]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Store, Engine]]:
    model = make_tiny_model(TINY)
    store = open_store(Path(tmp_path_factory.mktemp("dss-tp")), host_gib=1.0)
    address, authkey = store.serve_rpc()
    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank (else "Not enough NUMA nodes")
    try:
        engine = Engine(
            address,
            authkey,
            deterministic_batches=True,
            model=model,
            max_model_len=2048,
            tensor_parallel_size=2,  # the factory picks vLLM's mp executor for it
        )
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old
    try:
        yield store, engine
    finally:
        engine.close()
        store.close()


def test_a_tensor_parallel_engine_serves_turns_from_the_store(rig: tuple[Store, Engine]) -> None:
    store, engine = rig
    rng = np.random.default_rng(7)
    n = 3
    # Turn 1 stores its prompt and all but its last sampled token: 241 + 15 = two whole pages.
    prompts = [_tokens(rng, 2 * PAGE - 15) for _ in range(n)]
    first = engine.generate(prompts, [engine.session("tp", f"s{i}") for i in range(n)], 16)
    engine.settle()
    fps = [store.fingerprints.get(f) for f in store.fingerprints if store.fingerprints.get(f).tp_size == 2]
    assert len(fps) == 1 and fps[0].shards == 2 and fps[0].num_kv_heads == 1

    # Turn 2, two ways on the same engine: vLLM's prefix cache holding turn 1's blocks, then (that
    # cache emptied) DSS loading the pages both ranks saved of them. The same KV bytes: the same
    # tokens.
    second = [p + r.output_ids + _tokens(rng, 40) for p, r in zip(prompts, first, strict=True)]
    warm = engine.generate(second, [None] * n, 24)
    engine.reset_prefix_cache()
    dss = engine.generate(second, [engine.session("tp", f"s{i}") for i in range(n)], 24)
    for i, (w, d) in enumerate(zip(warm, dss, strict=True)):
        assert d.loaded_tokens == 2 * PAGE == w.num_cached_tokens == d.num_cached_tokens, (i, d.params)
        assert d.output_ids == w.output_ids, f"session {i}: DSS {d.output_ids} != prefix cache {w.output_ids}"
    engine.settle()

    # Turn 3 continues past a page boundary: its history ends in a tail page both ranks saved.
    engine.reset_prefix_cache()
    third = [p + r.output_ids + _tokens(rng, 9) for p, r in zip(second, dss, strict=True)]
    again = engine.generate(third, [engine.session("tp", f"s{i}") for i in range(n)], 8)
    for i, (p, r, a) in enumerate(zip(second, dss, again, strict=True)):
        want = len(p) + len(r.output_ids) - 1  # turn 2's history, all but its last sampled token
        assert want % PAGE, "the case must end in a tail page"
        assert a.loaded_tokens == want, (i, a.params)
