"""Hot hit: TTFT of a 3k-token context loaded from DSS's host tier vs served by vLLM's own warm
prefix cache (goal: ratio <= 1.3); a cold prefill is measured beside them for scale.

One engine with the DSS connector and vLLM's prefix caching on. Each repetition runs the same
prompt three ways, interleaved so machine noise hits all three alike: cold (vLLM's cache emptied,
no session), hot (cache emptied, the session's pages copied from the host arena) and APC (right
after the hot run, vLLM's own cache holds the same blocks). Both cached runs reuse the same
number of tokens and compute the same tail.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _engine_common import (
    BS,
    ServedStore,
    TimedEngine,
    main_on_one_engine,
    median,
    ms,
    ratio,
    session_params,
    text_of_tokens,
)

CONTEXT_TOKENS = 3000
REPS = 7
SMOKE_CONTEXT_TOKENS, SMOKE_REPS = 400, 1


def run(served: ServedStore, engine: TimedEngine, smoke: bool = False) -> dict[str, float]:
    """The measurement on a store and an engine with prefix caching on (both the caller's)."""
    engine.warm_up()
    rng = np.random.default_rng(3)
    prompt = engine.chat_ids(
        [{"role": "user", "content": text_of_tokens(rng, SMOKE_CONTEXT_TOKENS if smoke else CONTEXT_TOKENS)}]
    )
    # Like with like: the prompt is cut to whole blocks plus one token. The first request stores
    # its computed tokens (the whole prompt: its whole pages and a one-token tail page); a load
    # leaves the last prompt token to compute, so DSS and vLLM's own cache then both reuse exactly
    # the whole blocks and compute the same last token.
    prompt = prompt[: ((len(prompt) - 1) // BS) * BS + 1]
    reuse = len(prompt) - 1
    assert reuse % BS == 0 and reuse > 0
    stored = len(prompt) // BS + 1  # whole pages and the tail page
    reps = SMOKE_REPS if smoke else REPS
    sess = session_params(served.authkey, served.store.identity.tenant_for("hot-user"), "hot-session")
    first = engine.timed(prompt, sess, reset=True)
    params = first.result.params
    if params is None or params["stored_pages"] != stored:
        raise RuntimeError(
            f"the first request stored {params and params['stored_pages']} pages, not {stored}"
        )
    if not served.wait_for_host_pages(engine, stored, timeout_s=30):
        raise RuntimeError("the first request's pages never reached the host tier")
    print(f"context={len(prompt)} tokens, reused={reuse} ({reuse // BS} pages), reps={reps}", flush=True)

    cold, hot, apc = [], [], []
    for _ in range(reps):
        c = engine.timed(prompt, None, reset=True)
        h = engine.timed(prompt, sess, reset=True)
        a = engine.timed(prompt, None)
        if c.result.num_cached_tokens != 0:
            raise RuntimeError(f"the cold run reused {c.result.num_cached_tokens} tokens")
        if h.result.loaded_tokens != reuse or h.result.num_cached_tokens != reuse:
            raise RuntimeError(f"the hot run loaded {h.result.loaded_tokens}, expected {reuse}")
        if a.result.num_cached_tokens != reuse or a.result.params is not None:
            raise RuntimeError(f"the APC run reused {a.result.num_cached_tokens}, expected {reuse}")
        if not h.result.output_ids == a.result.output_ids:
            raise RuntimeError("DSS and vLLM's prefix cache answered differently from the same KV")
        cold.append(c.ttft_s)
        hot.append(h.ttft_s)
        apc.append(a.ttft_s)
    served.store.check()
    print(f"cold {ms(cold)}\nhot  {ms(hot)}\napc  {ms(apc)}")
    print(
        f"median TTFT: cold {1000 * median(cold):.0f} ms, DSS host {1000 * median(hot):.0f} ms, "
        f"vLLM APC {1000 * median(apc):.0f} ms; hot_vs_cold={ratio(median(hot), median(cold)):.3f}"
    )
    return {"hot_vs_apc": ratio(median(hot), median(apc))}


def main() -> None:
    main_on_one_engine("engine_hot", run)


if __name__ == "__main__":
    main()
