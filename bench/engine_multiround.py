"""Multi-round chat under KV pressure: mean TTFT of rounds >= 2 for plain vLLM without prefix
caching, vLLM with its own prefix caching (APC) only, and vLLM + DSS (goal DSS / APC <= 0.25).

N sessions of ~2k-token contexts take turns round-robin. vLLM's own KV cache is cut to fewer
blocks than two sessions need (`num_gpu_blocks_override`), so by the time a session comes back
its blocks are long evicted: APC alone cannot hold the working set, which is when an external
store pays off. vLLM's native CPU offloading (`kv_offloading_size`) is tried as a fourth column.
One engine per configuration, all alive at once: each session's turn goes to every configuration
back to back, so the load of the shared machine hits every column alike. All columns send the same
conversations (their own greedy answers, so later prompts can differ by a few tokens).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _engine_common import (
    BS,
    ServedStore,
    TimedEngine,
    capture_output,
    header,
    median,
    ms,
    print_result,
    ratio,
    root_cause,
    session_params,
    smoke_flag,
    text_of_tokens,
)

N_SESSIONS = 6
ROUNDS = 3
FIRST_TOKENS = 2000
FOLLOWUP_TOKENS = 120
ANSWER_TOKENS = 16
MAX_MODEL_LEN = 3072
GPU_BLOCKS = 32  # 4,096 tokens: less than two sessions' contexts, against a working set of ~6 x 2.3k
OFFLOAD_GIB = 1.0
# vLLM's worker busy-polls its input queue for 1 s after its last message (shm_broadcast
# `busy_loop_s`), and every CPU worker here is pinned to the same core: without a pause, the engine
# that just answered steals that core from the next engine's request, which penalises short
# (cached) requests most.
IDLE_GAP_S = 1.2

SessionFn = Callable[[int, int], dict[str, Any] | None]


@dataclass
class Script:
    """What every configuration sends: the first messages and the later user texts per session."""

    first: list[list[dict[str, str]]]
    followups: list[list[str]]


@dataclass
class Column:
    """One configuration: its engine, its sessions' prompts so far, and what it measured."""

    name: str
    engine: TimedEngine
    session_fn: SessionFn
    prompts: list[list[int]] = field(default_factory=list)
    ttft: dict[int, list[float]] = field(default_factory=dict)  # round -> per-session TTFT
    reused: dict[int, list[int]] = field(default_factory=dict)  # round -> tokens not recomputed

    def later_rounds(self) -> list[float]:
        return [t for r, ts in self.ttft.items() if r >= 2 for t in ts]

    def mean_later(self) -> float:
        xs = self.later_rounds()
        return sum(xs) / len(xs) if xs else float("nan")

    def mean_reused_later(self) -> float:
        xs = [x for r, ns in self.reused.items() if r >= 2 for x in ns]
        return sum(xs) / len(xs) if xs else float("nan")


def make_script(seed: int = 1) -> Script:
    rng = np.random.default_rng(seed)
    first = [
        [
            {
                "role": "user",
                "content": f"Session {i}. Keep these words in mind: {text_of_tokens(rng, FIRST_TOKENS)}",
            }
        ]
        for i in range(N_SESSIONS)
    ]

    def followup(r: int) -> str:
        return f"Round {r + 2}: which words relate to {text_of_tokens(rng, FOLLOWUP_TOKENS)}?"

    followups = [[followup(r) for r in range(ROUNDS)] for _ in range(N_SESSIONS)]
    return Script(first, followups)


def run_rounds(cols: list[Column], script: Script) -> None:
    """Round-robin over sessions; each session's turn goes to every configuration back to back
    (in a rotating order), so a change in the shared machine's load hits all columns alike."""
    for col in cols:
        col.engine.warm_up()
        col.prompts = [col.engine.chat_ids(m) for m in script.first]
    for rnd in range(1, ROUNDS + 1):
        for col in cols:
            col.ttft[rnd], col.reused[rnd] = [], []
        for s in range(N_SESSIONS):
            shift = (s + rnd) % len(cols)
            for col in cols[shift:] + cols[:shift]:
                time.sleep(IDLE_GAP_S)
                t = col.engine.timed(col.prompts[s], col.session_fn(s, rnd), ANSWER_TOKENS)
                col.ttft[rnd].append(t.ttft_s)
                col.reused[rnd].append(t.result.num_cached_tokens)
                if rnd < ROUNDS:
                    nxt = script.followups[s][rnd - 1]
                    col.prompts[s] = col.engine.continue_ids(col.prompts[s], t.result.output_ids, nxt)
        for col in cols:
            print(
                f"  {col.name:13s} round {rnd}: TTFT {ms(col.ttft[rnd])}, reused {col.reused[rnd]}",
                flush=True,
            )


def plain(_s: int, _r: int) -> None:
    return None


def start_offload() -> TimedEngine | str:
    """vLLM's native CPU offloading, or one line saying why it does not start on this build."""
    t0 = time.monotonic()
    try:
        with capture_output() as lines:
            return TimedEngine(
                None,
                None,
                connector=False,
                max_model_len=MAX_MODEL_LEN,
                num_gpu_blocks_override=GPU_BLOCKS,
                enable_prefix_caching=True,
                extra_engine_args={"kv_offloading_size": OFFLOAD_GIB, "kv_offloading_backend": "native"},
            )
    except Exception as exc:
        print(f"  vllm+offload failed to start after {time.monotonic() - t0:.0f} s", flush=True)
        return root_cause(lines, exc)


def main() -> None:
    global N_SESSIONS, ROUNDS, FIRST_TOKENS, FOLLOWUP_TOKENS
    if smoke_flag():  # tiny sizes: the script runs end to end, the numbers mean little
        N_SESSIONS, ROUNDS, FIRST_TOKENS, FOLLOWUP_TOKENS = 2, 2, 300, 40
    header("engine_multiround")
    script = make_script()
    print(
        f"sessions={N_SESSIONS} rounds={ROUNDS} first message ~{FIRST_TOKENS} tokens, "
        f"follow-ups ~{FOLLOWUP_TOKENS}, answers {ANSWER_TOKENS}; vLLM's cache {GPU_BLOCKS} blocks of {BS}",
        flush=True,
    )
    common: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "num_gpu_blocks_override": GPU_BLOCKS}
    served = ServedStore(host_gib=1.0)
    tenants = [served.store.identity.tenant_for(f"multiround-user-{s}") for s in range(N_SESSIONS)]

    def dss_session(s: int, rnd: int) -> dict[str, Any]:
        return session_params(served.authkey, tenants[s], f"multiround-{s}")

    cols: list[Column] = []
    offload: TimedEngine | str = "not tried"
    try:
        t0 = time.monotonic()
        # One engine per configuration, all alive at once so that their requests interleave.
        engine = TimedEngine(None, None, connector=False, enable_prefix_caching=False, **common)
        cols.append(Column("vllm-nocache", engine, plain))
        engine = TimedEngine(None, None, connector=False, enable_prefix_caching=True, **common)
        cols.append(Column("vllm-apc", engine, plain))
        engine = TimedEngine(served.address, served.authkey, enable_prefix_caching=True, **common)
        cols.append(Column("vllm+dss", engine, dss_session))
        offload = start_offload()
        if isinstance(offload, TimedEngine):
            cols.append(Column("vllm+offload", offload, plain))
        print(f"engines started in {time.monotonic() - t0:.0f} s", flush=True)
        run_rounds(cols, script)
        served.store.check()
    finally:
        for col in cols:
            col.engine.close()
        served.close()

    nocache, apc, dss = cols[:3]
    context = [len(p) for p in nocache.prompts]
    print(f"context at round {ROUNDS}: {context} tokens (working set ~{sum(context)} tokens)")
    print("mean TTFT of rounds >= 2 (round 1, cold everywhere, for scale):")
    for c in cols:
        r1 = sum(c.ttft[1]) / len(c.ttft[1])
        print(
            f"  {c.name:13s} {1000 * c.mean_later():7.0f} ms (median {1000 * median(c.later_rounds()):.0f})"
            f"  round 1: {1000 * r1:.0f} ms  mean reused tokens {c.mean_reused_later():.0f}"
        )
    if isinstance(offload, str):
        print(f"vllm+offload (kv_offloading_size={OFFLOAD_GIB} GiB, native) did not run: {offload}")
    else:
        print(f"offload_vs_apc={ratio(cols[3].mean_later(), apc.mean_later()):.3f}")
    print_result(
        dss_vs_apc=ratio(dss.mean_later(), apc.mean_later()),
        dss_vs_nocache=ratio(dss.mean_later(), nocache.mean_later()),
    )


if __name__ == "__main__":
    main()
