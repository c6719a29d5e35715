"""How many tokens a sliding-window model fits in the engine's KV cache with DSS, against plain vLLM.

vLLM's hybrid KV cache manager gives a sliding-window layer blocks only for its window, so a
model like Gemma 2/3, gpt-oss or Mistral fits several times more tokens in the same memory than
with full-size KV for every layer. A connector without `SupportsHMA` turns that manager off.
Here a tiny Gemma-2-style model (layers alternating a 64-token window and full attention) is
started with the same `VLLM_CPU_KVCACHE_SPACE` three ways, and vLLM's own figures are read from
the engine (`cache_config.kv_cache_size_tokens` and `kv_cache_max_concurrency`, what it logs as
"KV cache size: N tokens, Maximum concurrency ..."):

Prefills run in chunks of 512 tokens (as on GPU; see `run`).

- plain vLLM (hybrid manager on, its default);
- vLLM with the DSS connector (hybrid manager on: the connector implements `SupportsHMA`);
- (not with `--smoke`) vLLM with the DSS connector and the hybrid manager off, which is what DSS
  forced before, for scale.

Each DSS engine also answers one two-turn session, so its capacity is measured with caching on
(the second turn must load what the first stored).

    RESULT swa_capacity_vs_vllm=<DSS tokens / plain vLLM tokens> (target >= 0.95)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _engine_common import Engine, ServedStore, header, print_result, smoke_flag, words

from tests.engine_helpers import model_path
from tests.tiny_models import SWA_BLOCK_SIZE, tiny_gemma2


def capacity(engine: Engine) -> tuple[int, float, int]:
    """vLLM's KV cache token capacity, its max concurrency at max_model_len, and its KV cache
    groups, read from the engine core (in this process)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    core = engine.llm.llm_engine.engine_core.engine_core
    kv_config = core.scheduler.kv_cache_config
    tokens, concurrency = get_kv_cache_capacity(core.vllm_config, kv_config)
    return tokens, concurrency, len(kv_config.kv_cache_groups)


def two_turns(engine: Engine, served: ServedStore) -> tuple[int, int]:
    """Tokens turn 2 loaded from the store, and what it could have (turn 1's computed tokens)."""
    rng = np.random.default_rng(0)
    tenant = served.store.identity.tenant_for("capacity-user")
    prompt = engine.chat_ids([{"role": "user", "content": words(rng, 150)}])
    engine.reset_prefix_cache()
    (first,) = engine.generate([prompt], [engine.session(tenant, "s")], 96)
    nxt = engine.continue_ids(prompt, first.output_ids, words(rng, 20))
    engine.settle()
    engine.reset_prefix_cache()
    (second,) = engine.generate([nxt], [engine.session(tenant, "s")], 8)
    return second.loaded_tokens, len(prompt) + len(first.output_ids) - 1


def run(model: Path, smoke: bool) -> dict[str, float]:
    settings: dict[str, Any] = {
        "model": model,
        "block_size": SWA_BLOCK_SIZE,
        "max_model_len": 2048 if smoke else 8192,
        "kv_cache_space_gib": 1,
        "deterministic_batches": True,  # the engine core in this process: its config is readable
    }
    # Prefills in chunks, as on GPU: with whole prefills (the factory's CPU default) vLLM must
    # admit a prompt's every token into a sliding-window group at once, so it sizes that group
    # like full attention and the hybrid manager's saving does not show in its figures.
    chunked = {"enable_chunked_prefill": True, "max_num_batched_tokens": 512}
    served = ServedStore(host_gib=1.0)
    rows: dict[str, tuple[int, float, int]] = {}
    reuse: dict[str, float] = {}
    try:
        layouts: list[tuple[str, bool, dict[str, Any]]] = [
            ("vllm", False, chunked),
            ("dss", True, chunked),
        ]
        if not smoke:
            layouts.append(("dss_hybrid_off", True, {**chunked, "disable_hybrid_kv_cache_manager": True}))
        for name, connector, extra in layouts:
            address, authkey = (served.address, served.authkey) if connector else (None, None)
            engine = Engine(address, authkey, connector=connector, extra_engine_args=extra, **settings)
            try:
                rows[name] = capacity(engine)
                if connector:
                    loaded, reusable = two_turns(engine, served)
                    if loaded != reusable:
                        raise AssertionError(f"{name}: turn 2 loaded {loaded} of {reusable} tokens")
                    reuse[name] = loaded / reusable
            finally:
                engine.close()
        served.store.flush()  # the disk writer done before the store closes
    finally:
        served.close()
    print(f"{'engine':<16} {'KV tokens':>12} {'concurrency':>12} {'groups':>7} {'turn-2 reuse':>13}")
    for name, (tokens, concurrency, groups) in rows.items():
        r = f"{reuse[name]:.3f}" if name in reuse else "-"
        print(f"{name:<16} {tokens:>12,} {concurrency:>11.2f}x {groups:>7} {r:>13}")
    result = {"swa_capacity_vs_vllm": rows["dss"][0] / rows["vllm"][0]}
    if "dss_hybrid_off" in rows:
        result["hybrid_off_vs_vllm"] = rows["dss_hybrid_off"][0] / rows["vllm"][0]
    return result


def main() -> None:
    smoke = smoke_flag()
    header("swa_capacity")
    with tempfile.TemporaryDirectory(prefix="dss-swa-") as tmp:
        result = run(tiny_gemma2(Path(tmp), model_path()), smoke)
    print_result(**result)


if __name__ == "__main__":
    main()
