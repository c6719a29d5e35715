"""Rollback: a 6-turn session is rolled back 3 versions and continued with a new question; TTFT of
that turn through DSS vs vLLM's own warm prefix cache (goal <= 1.3) and vs recomputation.

Every turn is committed as a version (`store.versions.commit`), the branch head is moved back
with `store.versions.rollback`, and the continuation is built from the stored tokens of the
version rolled back to. Each repetition asks a different new question three ways, vLLM's cache
emptied before each: recompute (no session), DSS (the session: pages of the old state load from
the host tier) and APC (vLLM's cache first warmed with turn 4's prompt, as if vLLM had kept the
whole conversation: it then holds the same prefix blocks DSS loads). Then the new path goes on
one more turn, which loads the rolled-back continuation's own pages.
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
    main_on_one_engine,
    median,
    ms,
    ratio,
    served_by,
    text_of_tokens,
)

TURNS = 6
BACK = 3
FIRST_TOKENS = 1000
FOLLOWUP_TOKENS = 250
ANSWER_TOKENS = 24
REPS = 4
USER = "rollback-user"


@dataclass(frozen=True)
class Sizes:
    turns: int = TURNS
    back: int = BACK
    first_tokens: int = FIRST_TOKENS
    followup_tokens: int = FOLLOWUP_TOKENS
    answer_tokens: int = ANSWER_TOKENS
    reps: int = REPS


SMOKE = Sizes(turns=4, back=2, first_tokens=300, followup_tokens=60, answer_tokens=8, reps=2)


def run(served: ServedStore, engine: TimedEngine, smoke: bool = False) -> dict[str, float]:
    """The measurement on a store and an engine with prefix caching on (both the caller's)."""
    z = SMOKE if smoke else Sizes()
    store = served.store
    engine.warm_up()
    rng = np.random.default_rng(9)
    tenant = store.identity.tenant_for(USER)
    sid = store.versions.create_session(USER, "rollback-session").id
    messages = [{"role": "user", "content": f"Remember: {text_of_tokens(rng, z.first_tokens)}"}]
    prompt = engine.chat_ids(messages)
    states: list[tuple[list[int], list[int]]] = []
    saved: list[list[int]] = []  # what the session's DSS runs stored (their computed tokens)
    for turn in range(1, z.turns + 1):
        t = engine.timed(prompt, engine.session(tenant, sid), z.answer_tokens, reset=True)
        if t.result.loaded_tokens != served_by(saved, prompt):
            raise RuntimeError(f"turn {turn} loaded {t.result.loaded_tokens}, not {served_by(saved, prompt)}")
        out = t.result.output_ids
        messages.append({"role": "assistant", "content": t.result.text})
        v = store.versions.commit(USER, sid, tokens=[*prompt, *out], messages=messages)
        assert v.number == turn
        states.append((prompt, out))
        saved += computed([(prompt, out)])
        if turn < z.turns:
            question = f"Tell me more about {text_of_tokens(rng, z.followup_tokens)}"
            messages.append({"role": "user", "content": question})
            prompt = engine.continue_ids(prompt, out, question)
    target = z.turns - z.back
    store.versions.rollback(USER, sid, "main", target, expected_head=z.turns)
    version = store.versions.get_version(USER, sid, target)
    base_prompt, base_out = states[target - 1]
    stored = version.tokens.tolist()
    if stored != [*base_prompt, *base_out]:
        raise RuntimeError("the stored version does not hold the tokens of its turn")
    turn_after = states[target][0]  # what vLLM saw next before the rollback
    print(
        f"history: {z.turns} turns, contexts {[len(p) for p, _ in states]} tokens; "
        f"rolled back to version {target} ({len(version.tokens)} tokens)",
        flush=True,
    )

    recompute, dss, apc, reused = [], [], [], []
    first_continuation: tuple[list[int], list[int]] | None = None
    for rep in range(z.reps):
        question = f"Instead, describe {text_of_tokens(rng, z.followup_tokens)}"
        new = engine.continue_ids(stored[:-1], stored[-1:], question)
        r = engine.timed(new, None, z.answer_tokens, reset=True)
        d = engine.timed(new, engine.session(tenant, sid), z.answer_tokens, reset=True)
        engine.timed(turn_after, None, reset=True)  # vLLM's cache as if it had kept the dialogue
        a = engine.timed(new, None, z.answer_tokens)
        if r.result.num_cached_tokens != 0:
            raise RuntimeError(f"the recompute run reused {r.result.num_cached_tokens} tokens")
        # Like with like: DSS serves the longest prefix the session stored (the old state's whole
        # pages, then a tail page, or a later turn's page as far as the new turn shares it); vLLM's
        # warm cache the whole blocks of the prefix it shares with the turn after the old state.
        want_dss, want_apc = served_by(saved, new), apc_reuse([turn_after], new)
        if want_apc < len(stored) // BS * BS or want_dss < want_apc:
            raise RuntimeError(f"the rolled-back state is not reusable: DSS {want_dss}, vLLM {want_apc}")
        if d.result.loaded_tokens != want_dss or d.result.num_cached_tokens != want_dss:
            raise RuntimeError(
                f"DSS loaded {d.result.loaded_tokens} tokens ({d.result.num_cached_tokens} cached), "
                f"expected {want_dss}"
            )
        if a.result.num_cached_tokens != want_apc:
            raise RuntimeError(f"vLLM's warm cache reused {a.result.num_cached_tokens}, expected {want_apc}")
        if rep == 0 and want_dss // BS * BS != want_apc:
            raise RuntimeError(f"DSS's whole pages ({want_dss}) and vLLM's blocks ({want_apc}) differ")
        recompute.append(r.ttft_s)
        dss.append(d.ttft_s)
        apc.append(a.ttft_s)
        reused.append(d.result.loaded_tokens)
        saved += computed([(new, d.result.output_ids)])
        if rep == 0:
            first_continuation = (new, d.result.output_ids)
            messages = [*version.messages, {"role": "user", "content": question}]
            messages.append({"role": "assistant", "content": d.result.text})
            v = store.versions.commit(
                USER, sid, tokens=[*new, *d.result.output_ids], messages=messages, expected_head=target
            )
            assert v.parent == target

    # ... and the new path continues: its next turn loads the continuation's own pages.
    assert first_continuation is not None
    new, out = first_continuation
    nxt = engine.continue_ids(new, out, f"And finally {text_of_tokens(rng, 60)}")
    n = engine.timed(nxt, engine.session(tenant, sid), z.answer_tokens, reset=True)
    want_next = served_by(saved, nxt)
    if n.result.loaded_tokens != want_next or want_next < len(new) + len(out) - 1:
        raise RuntimeError(f"the next turn loaded {n.result.loaded_tokens}, not {want_next}")
    store.check()

    print(f"rolled-back turn: context ~{len(new)} tokens, reused {reused} tokens (DSS)")
    print(f"recompute {ms(recompute)}\ndss       {ms(dss)}\napc       {ms(apc)}")
    print(
        f"median TTFT: DSS {1000 * median(dss):.0f} ms, vLLM warm cache {1000 * median(apc):.0f} ms, "
        f"recompute {1000 * median(recompute):.0f} ms; next turn on the new path {1000 * n.ttft_s:.0f} ms "
        f"({n.result.loaded_tokens} tokens loaded)"
    )
    return {
        "rollback_vs_apc": ratio(median(dss), median(apc)),
        "rollback_vs_recompute": ratio(median(dss), median(recompute)),
    }


def main() -> None:
    main_on_one_engine("engine_rollback", run)


if __name__ == "__main__":
    main()
