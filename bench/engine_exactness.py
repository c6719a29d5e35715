"""Exactness as a script: greedy answers through DSS vs cold recomputation, token for token, over
20 multi-turn conversations plus rollback-then-continue and branch-then-continue cases.

The 20 conversations run in batches on an engine whose core runs in this process (so a batch is
scheduled the same way every run); the rollback and branch cases run one request at a time on an
engine split into processes as a server runs it. Every turn runs three ways: "warm" (plain vLLM
right after the previous turn's DSS run: its own prefix cache holds exactly the bytes the store
saved), "cold" (caches emptied, everything recomputed) and "DSS" (vLLM's cache emptied, the
session's pages loaded from the store).

`divergences` counts turns whose DSS answer differs from the cold one (goal 0). Beside it:
`apc_divergences`, the same count for vLLM's own prefix cache (warm vs cold: KV reuse on this
CPU backend is not bit-identical to a one-shot prefill), and `dss_apc_mismatches`, turns
where DSS and vLLM's cache reused the same number of tokens and still answered differently,
which would mean a wrong page (must be 0); `dss_only_divergences` counts DSS-vs-cold divergences
on turns where vLLM's own cache agreed with cold.

DSS also stores a turn's partial last block (a tail page), which vLLM's own cache cannot reuse:
on such turns DSS serves more tokens than warm (`tail_turns`), and warm recomputes that block in
one prefill where DSS reuses KV computed during decoding: their differences (`tail_divergences`)
are the same kind as cached-vs-cold ones, counted, not mismatches. Every DSS load must be exactly
the longest prefix the user's stored sequences share with the prompt (`load_misses`, must be 0).
Each conversation is its own user, so a turn reuses its own history only (one user's
conversations share their chat template's first tokens).

`--smoke`: one conversation and one branch case, on one engine.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _engine_common import (
    Engine,
    Result,
    ServedStore,
    computed,
    header,
    make_conversations,
    print_result,
    served_by,
    smoke_flag,
    words,
)

N_CONVERSATIONS = 20
CASES = [("rollback", 11), ("rollback", 13), ("branch", 12), ("branch", 14)]


@dataclass
class Tally:
    conversations: int = 0
    turns: int = 0
    divergences: int = 0
    apc_divergences: int = 0
    apc_compared: int = 0
    dss_apc_mismatches: int = 0
    dss_only_divergences: int = 0  # DSS differs from cold where vLLM's own cache does not
    tail_turns: int = 0  # DSS served more than vLLM's cache: a tail page
    tail_divergences: int = 0  # ... and answered differently from it
    load_misses: int = 0
    notes: list[str] = field(default_factory=list)

    def add(
        self,
        names: list[str],
        warm: list[Result] | None,
        cold: list[Result],
        dss: list[Result],
        want: list[int],
    ) -> None:
        for k, name in enumerate(names):
            d, c = dss[k], cold[k]
            self.turns += 1
            if c.num_cached_tokens != 0 or c.params is not None:
                raise RuntimeError(f"{name}: the cold run reused a cache")
            if d.loaded_tokens != want[k]:
                self.load_misses += 1
                self.notes.append(f"{name}: loaded {d.loaded_tokens} tokens, expected {want[k]}")
            if d.output_ids != c.output_ids:
                self.divergences += 1
                self.notes.append(f"{name}: DSS {d.text!r} != cold {c.text!r}")
            if warm is not None:
                w = warm[k]
                self.apc_compared += 1
                if w.output_ids != c.output_ids:
                    self.apc_divergences += 1
                    self.notes.append(f"{name}: vLLM prefix cache {w.text!r} != cold {c.text!r}")
                elif d.output_ids != c.output_ids:
                    self.dss_only_divergences += 1
                if d.num_cached_tokens < w.num_cached_tokens:
                    self.load_misses += 1
                    self.notes.append(f"{name}: vLLM reused {w.num_cached_tokens}, DSS {d.num_cached_tokens}")
                elif d.num_cached_tokens > w.num_cached_tokens:
                    self.tail_turns += 1
                    if w.output_ids != d.output_ids:
                        self.tail_divergences += 1
                        self.notes.append(f"{name} (tail page): DSS {d.text!r} != vLLM cache {w.text!r}")
                elif w.output_ids != d.output_ids:
                    self.dss_apc_mismatches += 1
                    self.notes.append(f"{name}: DSS {d.text!r} != vLLM prefix cache {w.text!r}")


def three_ways(
    engine: Engine,
    prompts: list[list[int]],
    sessions: list[dict[str, Any]],
    max_tokens: list[int],
    warm: bool,
) -> tuple[list[Result] | None, list[Result], list[Result]]:
    """(warm, cold, DSS) of one turn; call it right after the previous turn's DSS run."""
    warm_results = engine.generate(prompts, [None] * len(prompts), max_tokens) if warm else None
    engine.reset_prefix_cache()
    cold = engine.generate(prompts, [None] * len(prompts), max_tokens)
    engine.reset_prefix_cache()
    dss = engine.generate(prompts, sessions, max_tokens)
    return warm_results, cold, dss


def expected_loaded(prev_prompt: list[int], prev_output: list[int], prompt: list[int]) -> int:
    """What DSS serves of `prompt` after one earlier turn: the tokens the prompt shares with what
    that turn computed (all but its last sampled token: whole pages and a tail page)."""
    return served_by(computed([(prev_prompt, prev_output)]), prompt)


def conversations(engine: Engine, served: ServedStore, tally: Tally, n: int = N_CONVERSATIONS) -> None:
    convs = make_conversations(n)
    tenants = [served.store.identity.tenant_for(f"exactness-user-{i}") for i in range(len(convs))]
    prompts = [engine.chat_ids(c.first) for c in convs]
    print(
        f"{len(convs)} conversations, turn-1 prompts of {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens"
    )
    prev: list[tuple[list[int], list[int]] | None] = [None] * len(convs)
    engine.reset_prefix_cache()
    for turn in range(max(len(c.followups) for c in convs) + 1):
        active = [i for i, c in enumerate(convs) if turn <= len(c.followups)]
        warm, cold, dss = three_ways(
            engine,
            [prompts[i] for i in active],
            [engine.session(tenants[i], convs[i].session_id) for i in active],
            [convs[i].max_tokens for i in active],
            warm=turn > 0,
        )
        want = []
        for i in active:
            p = prev[i]
            want.append(expected_loaded(*p, prompts[i]) if p is not None else 0)
        tally.add([f"{convs[i].name} turn {turn + 1}" for i in active], warm, cold, dss, want)
        for i, d in zip(active, dss, strict=True):
            if turn < len(convs[i].followups):
                prev[i] = (prompts[i], d.output_ids)
                prompts[i] = engine.continue_ids(prompts[i], d.output_ids, convs[i].followups[turn])
        print(
            f"  turn {turn + 1}: {len(active)} conversations, divergences so far {tally.divergences}",
            flush=True,
        )
    tally.conversations += len(convs)


def case(engine: Engine, served: ServedStore, kind: str, seed: int, tally: Tally) -> None:
    """Six turns then back to version 3 (rollback), or three turns then a branch from version 1;
    then two turns on the new path, each compared three ways."""
    store = served.store
    user = f"{kind}-user-{seed}"
    tenant = store.identity.tenant_for(user)
    sid = store.versions.create_session(user, f"{kind}-{seed}").id
    rng = np.random.default_rng(seed)
    turns, back_to = (6, 3) if kind == "rollback" else (3, 1)
    prompt = engine.chat_ids([{"role": "user", "content": f"Remember these words: {words(rng, 260)}"}])
    states: list[tuple[list[int], list[int]]] = []
    for turn in range(1, turns + 1):
        engine.reset_prefix_cache()
        (r,) = engine.generate([prompt], [engine.session(tenant, sid)], 20)
        want = served_by(computed(states), prompt)
        if r.loaded_tokens != want:
            tally.notes.append(
                f"{kind}-{seed} history turn {turn}: loaded {r.loaded_tokens}, expected {want}"
            )
        store.versions.commit(
            user, sid, tokens=[*prompt, *r.output_ids], messages=[{"role": "user", "content": "."}]
        )
        states.append((prompt, r.output_ids))
        prompt = engine.continue_ids(prompt, r.output_ids, f"Tell me more about {words(rng, 30)}")
    if kind == "rollback":
        store.versions.rollback(user, sid, "main", back_to, expected_head=turns)
        branch = "main"
    else:
        branch = "alt"
        store.versions.branch(user, sid, back_to, branch)
    base = store.versions.get_version(user, sid, back_to).tokens.tolist()
    if base != [*states[back_to - 1][0], *states[back_to - 1][1]]:
        raise RuntimeError(f"{kind}-{seed}: version {back_to} does not hold its turn's tokens")
    prev = states[back_to - 1]
    prompt = engine.continue_ids(*prev, f"Instead, describe {words(rng, 25)}")
    stored = computed(states)  # everything this user's DSS runs stored
    for step in range(2):
        sess = engine.session(tenant, sid)
        warm, cold, dss = three_ways(engine, [prompt], [sess], [24], warm=True)
        tally.add([f"{kind}-{seed} +{step + 1}"], warm, cold, dss, [served_by(stored, prompt)])
        out = dss[0].output_ids
        stored += computed([(prompt, out)])
        store.versions.commit(
            user, sid, tokens=[*prompt, *out], messages=[{"role": "user", "content": "."}], branch=branch
        )
        prev = (prompt, out)
        prompt = engine.continue_ids(prompt, out, f"And finally {words(rng, 20)}")
    tally.conversations += 1


def run(served: ServedStore, batch_engine: Engine, engine: Engine, smoke: bool = False) -> dict[str, int]:
    """The conversations on `batch_engine` (deterministic batches), the cases on `engine`."""
    tally = Tally()
    conversations(batch_engine, served, tally, 1 if smoke else N_CONVERSATIONS)
    for kind, seed in CASES[2:3] if smoke else CASES:
        case(engine, served, kind, seed, tally)
    served.store.check()
    for note in tally.notes:
        print("  ", note)
    print(
        f"{tally.conversations} conversations, {tally.turns} turns compared; "
        f"DSS vs cold: {tally.divergences} divergences; "
        f"vLLM prefix cache vs cold: {tally.apc_divergences} of {tally.apc_compared}; "
        f"DSS-only divergences: {tally.dss_only_divergences}; "
        f"DSS vs vLLM prefix cache on equal reuse: {tally.dss_apc_mismatches} mismatches; "
        f"with a tail page: {tally.tail_divergences} of {tally.tail_turns} differ; "
        f"wrong loads: {tally.load_misses}",
        flush=True,
    )
    return {
        "conversations": tally.conversations,
        "divergences": tally.divergences,
        "turns": tally.turns,
        "apc_divergences": tally.apc_divergences,
        "dss_only_divergences": tally.dss_only_divergences,
        "dss_apc_mismatches": tally.dss_apc_mismatches,
        "tail_turns": tally.tail_turns,
        "tail_divergences": tally.tail_divergences,
        "load_misses": tally.load_misses,
    }


def main() -> None:
    smoke = smoke_flag()
    header("engine_exactness")
    served = ServedStore(host_gib=2.0)
    try:
        # Batches of 20: the engine core in this process, so cold and DSS batches are scheduled
        # alike (vLLM's engine is not batch-invariant). vLLM then runs the worker in this process
        # too, so both connector halves share it. The cases run one request at a time, as a
        # server runs them: engine core and worker in processes of their own, the store in this one.
        # (Smoke: one conversation, one request at a time, on that second engine alone.)
        engine = Engine(served.address, served.authkey)
        try:
            if smoke:
                result = run(served, engine, engine, smoke)
            else:
                batch_engine = Engine(served.address, served.authkey, deterministic_batches=True)
                try:
                    result = run(served, batch_engine, engine, smoke)
                finally:
                    batch_engine.close()
        finally:
            engine.close()
    finally:
        served.close()
    print_result(**result)


if __name__ == "__main__":
    main()
