"""Restart: TTFT of a 3k-token session's next turn in a freshly started engine vs a cold prefill
(goal <= 0.15).

Engine A serves turn 1 of a few ~3k-token sessions through DSS and is shut down. Engine B starts
on the same live store (its host arena survives the engine): each session's turn 2 loads from the
host tier. Then the store is closed and reopened from its data directory too (a whole-server
restart: the arena is gone, pages come back from the disk tier through asynchronous loads) and a
third engine C serves the same turns again. Cold prefills of the same prompts are measured in B
and in C beside the loads they are compared with; in B, a run with vLLM's own cache warm with the
session's turn 1 (as if there had been no restart) shows how much of the DSS time is the restart's
and how much is the new turn's own prefill (the tail of turn 1 past its last full page, plus the
new user message). DSS loads all of turn 1 it computed (its whole pages and its tail page); vLLM's
warm cache only whole blocks of it, so the reference computes up to a block more.

`--smoke`: two short sessions.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _engine_common import (
    BS,
    ServedStore,
    TimedEngine,
    apc_reuse,
    computed,
    header,
    median,
    ms,
    print_result,
    ratio,
    served_by,
    smoke_flag,
    text_of_tokens,
)

SESSIONS = 8
TURN1_TOKENS = 2850
FOLLOWUP_TOKENS = 120
ANSWER_TOKENS = 16


@dataclass(frozen=True)
class Sizes:
    sessions: int = SESSIONS
    turn1_tokens: int = TURN1_TOKENS
    followup_tokens: int = FOLLOWUP_TOKENS
    answer_tokens: int = ANSWER_TOKENS


SMOKE = Sizes(sessions=2, turn1_tokens=400, followup_tokens=40, answer_tokens=8)


def measure(
    engine: TimedEngine,
    prompts: list[list[int]],
    tenant: str,
    version: int,
    want: list[int],
    label: str,
    primers: list[list[int]] | None = None,
) -> tuple[list[float], list[float], list[float]]:
    """(cold, DSS, APC) TTFTs of each session's turn-2 prompt, vLLM's cache emptied before the
    cold and DSS runs. With `primers` (the turn-1 sequences), vLLM's cache is then warmed with the
    session's turn 1, as if the engine had never restarted, and the prompt is run once more: the
    part of the DSS time that a restart costs at all."""
    engine.warm_up()
    cold, loaded, apc = [], [], []
    for k, prompt in enumerate(prompts):
        c = engine.timed(prompt, None, reset=True)
        d = engine.timed(prompt, engine.session(tenant, f"restart-{k}"), reset=True)
        if c.result.num_cached_tokens != 0:
            raise RuntimeError(f"{label}: the cold run reused {c.result.num_cached_tokens} tokens")
        if d.result.loaded_tokens != want[k]:
            raise RuntimeError(f"{label}: session {k} loaded {d.result.loaded_tokens}, expected {want[k]}")
        cold.append(c.ttft_s)
        loaded.append(d.ttft_s)
        if primers is not None:
            engine.timed(primers[k], None, reset=True)
            a = engine.timed(prompt, None)
            # Like with like: vLLM's cache holds the whole blocks of turn 1, DSS those and the tail.
            want_apc = apc_reuse([primers[k]], prompt)
            if a.result.num_cached_tokens != want_apc or want_apc != want[k] // BS * BS:
                raise RuntimeError(
                    f"{label}: vLLM's warm cache reused {a.result.num_cached_tokens}, not {want_apc} "
                    f"(the whole blocks of DSS's {want[k]})"
                )
            apc.append(a.ttft_s)
    print(
        f"  {label}: cold {ms(cold)}, DSS {ms(loaded)}" + (f", warm APC {ms(apc)}" if apc else ""), flush=True
    )
    return cold, loaded, apc


def run(
    served: ServedStore, a: TimedEngine | None = None, smoke: bool = False, in_process: bool = False
) -> dict[str, float]:
    """The measurement on a store; engine A (the caller's, or one started here) serves turn 1
    and is closed here, then two engines are started (`in_process`: in this process, as the
    suite's smoke starts them, seconds instead of half a minute each on 2 cores; the timings are
    then not a served engine's). The store is reopened: the caller's other engines on it stop
    working."""
    z = SMOKE if smoke else Sizes()
    tenant = served.store.identity.tenant_for("restart-user")
    rng = np.random.default_rng(5)

    a = a or TimedEngine(served.address, served.authkey, deterministic_batches=in_process)
    try:
        a.warm_up()
        turn1: list[list[int]] = []
        turn2: list[list[int]] = []
        want: list[int] = []
        saved_pages = 0
        for k in range(z.sessions):
            p1 = a.chat_ids([{"role": "user", "content": text_of_tokens(rng, z.turn1_tokens)}])
            t = a.timed(p1, a.session(tenant, f"restart-{k}"), z.answer_tokens, reset=True)
            p2 = a.continue_ids(p1, t.result.output_ids, text_of_tokens(rng, z.followup_tokens))
            (seq,) = computed([(p1, t.result.output_ids)])
            pages = -(-len(seq) // BS)  # whole pages and the tail page
            got = (t.result.params or {}).get("stored_pages")
            if got != pages:
                raise RuntimeError(f"session {k}'s turn 1 stored {got} pages, not {pages}")
            saved_pages += pages
            turn1.append([*p1, *t.result.output_ids])
            turn2.append(p2)
            want.append(served_by([seq], p2))  # all of turn 1 DSS computed
        # (The worker commits a finished request's last save after the request returned.)
        if not served.wait_for_host_pages(a, saved_pages, timeout_s=120):
            raise RuntimeError(
                f"engine A's pages never reached the store: {served.host_pages()} of {saved_pages}"
            )
    finally:
        a.close()
    print(f"turn-2 contexts {[len(p) for p in turn2]} tokens, loadable {want}", flush=True)

    b = TimedEngine(served.address, served.authkey, deterministic_batches=in_process)
    try:
        label = "engine restart (store alive, host tier)"
        cold_b, host_b, apc_b = measure(b, turn2, tenant, 2, want, label, primers=turn1)
    finally:
        b.close()

    served.reopen()
    if served.host_pages() != 0:
        raise RuntimeError("a reopened store should start with an empty host arena")
    # Engine B's turn-2 requests (one token each) stored their whole prompts: all but the last
    # prompt token loads now.
    want = [len(p) - 1 for p in turn2]
    c = TimedEngine(served.address, served.authkey, deterministic_batches=in_process)
    try:
        cold_c, disk_c, _ = measure(c, turn2, tenant, 3, want, "whole restart (store reopened, disk tier)")
    finally:
        c.close()
    served.store.check()

    restart = ratio(median(host_b), median(cold_b))
    full = ratio(median(disk_c), median(cold_c))
    print(
        f"median TTFT: engine restart {1000 * median(host_b):.0f} ms vs cold {1000 * median(cold_b):.0f} ms;"
        f" whole restart {1000 * median(disk_c):.0f} ms vs cold {1000 * median(cold_c):.0f} ms;"
        f" full_restart_vs_cold={full:.3f}"
    )
    print(
        f"no-restart reference (vLLM's cache warm with turn 1): {1000 * median(apc_b):.0f} ms, "
        f"apc_vs_cold={ratio(median(apc_b), median(cold_b)):.3f} "
        f"restart_vs_apc={ratio(median(host_b), median(apc_b)):.3f}"
    )
    return {"restart_vs_cold": restart, "full_restart_vs_cold": full}


def main() -> None:
    smoke = smoke_flag()
    header("engine_restart")
    # 2 GiB: 8 sessions' whole pages and tail pages (~184 pages of 5.9 MB) outgrow 1 GiB's 182.
    served = ServedStore(host_gib=2.0)
    try:
        result = run(served, None, smoke)
    finally:
        served.close()
    print_result(**result)


if __name__ == "__main__":
    main()
