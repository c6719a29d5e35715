"""Sliding-window (hybrid) models through DSS: vLLM's hybrid KV cache manager stays on, and a
cache never changes an answer.

One real vLLM CPU engine serves a tiny random-weight Gemma-2-style model made here: four layers
alternating a 64-token sliding window and full attention, so vLLM forms two KV cache groups and
frees a sliding-window layer's blocks once they fall out of its window. Turns and answers are
longer than the window, so loads end where only the stored pages can supply the window's KV.

Before: the connector did not implement `SupportsHMA`, so vLLM turned its hybrid manager off for
every model with DSS (full-size KV for window layers), and more than one KV cache group refused.

Random weights have near-ties: outputs are compared token by token, and where two runs differ
the first differing position must be a near-tie in both runs (each run's token is the other's
runner-up within `NEAR_TIE` nats). Why that tolerance: the runs compared reuse KV computed in
float32 by different kernels' orders (a one-shot prefill, decoding, the block a tail page ends
in), which moves logits by ~1e-6 relative; a wrong page (another position's KV, or a freed
window block's leftovers) moves them by O(0.1-1) nats and changes nearly every answer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dss.store import Store
from tests.engine_helpers import Engine, model_path, open_store, served_by, words
from tests.tiny_models import SWA_BLOCK_SIZE, SWA_WINDOW, tiny_gemma2

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BS = SWA_BLOCK_SIZE
NEAR_TIE = 1e-3  # nats; see the module docstring


@dataclass
class Out:
    ids: list[int]
    top: list[dict[int, float]]  # per output position: the two most likely tokens' logprobs
    params: dict[str, Any] | None
    num_cached_tokens: int

    @property
    def loaded(self) -> int:
        return int((self.params or {}).get("loaded_tokens", 0))


@dataclass
class Rig:
    store: Store
    engine: Engine


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    root = Path(tmp_path_factory.mktemp("dss-hybrid"))
    model = tiny_gemma2(root, model_path())
    store = open_store(root / "store", host_gib=1.0)
    address, authkey = store.serve_rpc()
    # A store call past its deadline is a miss, and the checks below count every token: a long
    # deadline, so a machine busy with other engines does not turn into a failed comparison.
    engine = Engine(
        address,
        authkey,
        deterministic_batches=True,
        model=model,
        dtype="float32",  # the near-tie tolerance is float32's (module docstring), on every CPU
        block_size=BS,
        max_model_len=2048,
        rpc_timeout_s=30.0,
    )
    try:
        yield Rig(store, engine)
    finally:
        engine.close()
        store.close()


def generate(
    engine: Engine, prompts: Sequence[Sequence[int]], sessions: Sequence[dict[str, Any] | None], n: int
) -> list[Out]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(max_tokens=n, temperature=0.0, logprobs=2, ignore_eos=True, extra_args=s)
        for s in sessions
    ]
    inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    outs = engine.llm.generate(inputs, params, use_tqdm=False)
    return [
        Out(
            list(o.outputs[0].token_ids),
            [{int(t): float(lp.logprob) for t, lp in pos.items()} for pos in (o.outputs[0].logprobs or [])],
            o.kv_transfer_params,
            int(o.num_cached_tokens or 0),
        )
        for o in outs
    ]


def difference(a: Out, b: Out) -> str | None:
    """None when `a` and `b` answer the same, "near-tie" when they first differ at a near-tie,
    else what differs."""
    if a.ids == b.ids:
        return None
    k = next(i for i, (x, y) in enumerate(zip(a.ids, b.ids, strict=False)) if x != y)
    ta, tb = a.ids[k], b.ids[k]
    for run, own, other in ((a, ta, tb), (b, tb, ta)):
        top = run.top[k]
        if other not in top or top[own] - top[other] > NEAR_TIE:
            return f"position {k}: {ta} vs {tb}, logprobs {a.top[k]} vs {b.top[k]}"
    return "near-tie"


def user_turn(engine: Engine, prompt: list[int], output: list[int], text: str) -> list[int]:
    return engine.continue_ids(prompt, output, text)


def test_the_hybrid_kv_cache_manager_stays_on(rig: Rig) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    config = rig.engine.llm.llm_engine.vllm_config
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    kv_config = rig.engine.llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    specs = [g.kv_cache_spec for g in kv_config.kv_cache_groups]
    assert len(specs) == 2, specs
    assert isinstance(specs[0], SlidingWindowSpec) and specs[0].sliding_window == SWA_WINDOW
    assert type(specs[1]) is FullAttentionSpec
    (fid,) = rig.store.fingerprints
    fp = rig.store.fingerprints.get(fid)
    assert fp.kv_groups == f"sliding{SWA_WINDOW}:0,2;full:1,3" and fp.block_size == BS


def test_multiturn_longer_than_the_window_is_exact(rig: Rig) -> None:
    """Each turn twice: vLLM's own prefix cache (holding the blocks the previous turn computed)
    and DSS (vLLM's cache emptied: every reused token comes from the store)."""
    engine, store = rig.engine, rig.store
    rng = np.random.default_rng(20)
    n_conv, n_turns = 4, 3
    tenants = [store.identity.tenant_for(f"hybrid-user-{i}") for i in range(n_conv)]
    lengths = [int(rng.integers(90, 260)) for _ in range(n_conv)]
    prompts = [
        engine.chat_ids([{"role": "user", "content": f"Conversation {i}: {words(rng, n)}"}])
        for i, n in enumerate(lengths)
    ]
    answer = [int(rng.integers(3, 6)) * SWA_WINDOW // 2 for _ in range(n_conv)]  # 96..160 tokens
    stored: list[list[list[int]]] = [[] for _ in range(n_conv)]
    mismatches: list[str] = []
    near_ties = loaded = want = 0
    first_turn_reuse: list[float] = []
    engine.reset_prefix_cache()
    for turn in range(n_turns):
        sessions = [engine.session(tenants[i], f"hybrid-{i}") for i in range(n_conv)]
        warm = generate(engine, prompts, [None] * n_conv, max(answer)) if turn else None
        engine.reset_prefix_cache()
        dss = generate(engine, prompts, sessions, max(answer))
        for i, d in enumerate(dss):
            expected = served_by(stored[i], prompts[i])
            assert d.params is not None and d.params["failed_tokens"] == 0, d.params
            if d.loaded != expected:
                mismatches.append(f"conv {i} turn {turn + 1}: loaded {d.loaded}, expected {expected}")
            loaded, want = loaded + d.loaded, want + expected
            if turn == 1:
                first_turn_reuse.append(d.loaded / len(stored[i][0]))
            if warm is not None:
                diff = difference(d, warm[i])
                near_ties += diff == "near-tie"
                if diff not in (None, "near-tie"):
                    mismatches.append(f"conv {i} turn {turn + 1}: DSS vs vLLM prefix cache, {diff}")
            stored[i].append([*prompts[i], *d.ids][:-1])
            prompts[i] = user_turn(engine, prompts[i], d.ids, f"Then {words(rng, int(rng.integers(10, 60)))}")
    print(
        f"\nhybrid exactness: {n_conv} conversations x {n_turns} turns, window {SWA_WINDOW}: "
        f"{len(mismatches)} mismatches, {near_ties} near-ties; loaded {loaded} of {want} reusable tokens; "
        f"turn 2 loaded {min(first_turn_reuse):.3f}..{max(first_turn_reuse):.3f} of turn 1"
    )
    assert not mismatches, "\n".join(mismatches)
    assert want > 0 and loaded == want
    assert min(first_turn_reuse) >= 0.98


def test_a_branch_inside_a_long_answer_loads_its_window(rig: Rig) -> None:
    """A fork that ends inside an answer several windows long: the sliding-window layers' KV
    there was freed by vLLM while the answer was decoded, so only pages saved before they left
    the window can serve it. DSS must load all of it and answer as a full recompute does."""
    engine, store = rig.engine, rig.store
    rng = np.random.default_rng(21)
    tenant = store.identity.tenant_for("hybrid-branch-user")
    prompt = engine.chat_ids([{"role": "user", "content": f"Tell a long story: {words(rng, 150)}"}])
    engine.reset_prefix_cache()
    (first,) = generate(engine, [prompt], [engine.session(tenant, "trunk")], 5 * SWA_WINDOW)
    assert len(first.ids) == 5 * SWA_WINDOW
    cut = 3 * SWA_WINDOW + 7  # well past the window, inside a block
    fork = user_turn(engine, prompt, first.ids[:cut], f"Instead, {words(rng, 20)}")
    engine.settle()
    engine.reset_prefix_cache()
    cold = generate(engine, [fork], [None], 48)[0]
    engine.reset_prefix_cache()
    (dss,) = generate(engine, [fork], [engine.session(tenant, "fork")], 48)
    assert dss.loaded == len(prompt) + cut, (dss.params, len(prompt) + cut)
    diff = difference(dss, cold)
    print(f"\nhybrid branch: loaded {dss.loaded} tokens; DSS vs recompute: {diff or 'identical'}")
    assert diff in (None, "near-tie"), diff
    assert len(set(dss.ids)) > len(dss.ids) // 2  # an answer that depends on its context
