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

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _engine_common import (
    BS,
    ServedStore,
    TimedEngine,
    header,
    median,
    ms,
    ratio,
    text_of_tokens,
)

TURNS = 6
BACK = 3
FIRST_TOKENS = 1000
FOLLOWUP_TOKENS = 250
ANSWER_TOKENS = 24
REPS = 4
USER = "rollback-user"


def main() -> None:
    header("engine_rollback")
    served = ServedStore(host_gib=1.0)
    store = served.store
    engine = TimedEngine(served.address, served.authkey, enable_prefix_caching=True)
    try:
        engine.warm_up()
        rng = np.random.default_rng(9)
        tenant = store.tenant_for(USER)
        sid = store.versions.create_session(USER, "rollback-session").id
        messages = [{"role": "user", "content": f"Remember: {text_of_tokens(rng, FIRST_TOKENS)}"}]
        prompt = engine.chat_ids(messages)
        states: list[tuple[list[int], list[int]]] = []
        for turn in range(1, TURNS + 1):
            t = engine.timed(prompt, engine.session(tenant, sid, turn), ANSWER_TOKENS, reset=True)
            out = t.result.output_ids
            messages.append({"role": "assistant", "content": t.result.text})
            v = store.versions.commit(USER, sid, tokens=[*prompt, *out], messages=messages)
            assert v.number == turn
            states.append((prompt, out))
            if turn < TURNS:
                question = f"Tell me more about {text_of_tokens(rng, FOLLOWUP_TOKENS)}"
                messages.append({"role": "user", "content": question})
                prompt = engine.continue_ids(prompt, out, question)
        target = TURNS - BACK
        store.versions.rollback(USER, sid, "main", target, expected_head=TURNS)
        version = store.versions.get_version(USER, sid, target)
        base_prompt, base_out = states[target - 1]
        stored = version.tokens.tolist()
        if stored != [*base_prompt, *base_out]:
            raise RuntimeError("the stored version does not hold the tokens of its turn")
        turn_after = states[target][0]  # what vLLM saw next before the rollback
        print(
            f"history: {TURNS} turns, contexts {[len(p) for p, _ in states]} tokens; "
            f"rolled back to version {target} ({len(version.tokens)} tokens)",
            flush=True,
        )

        recompute, dss, apc, reused = [], [], [], []
        first_continuation: tuple[list[int], list[int]] | None = None
        for rep in range(REPS):
            question = f"Instead, describe {text_of_tokens(rng, FOLLOWUP_TOKENS)}"
            new = engine.continue_ids(stored[:-1], stored[-1:], question)
            r = engine.timed(new, None, ANSWER_TOKENS, reset=True)
            d = engine.timed(new, engine.session(tenant, sid, TURNS + 1), ANSWER_TOKENS, reset=True)
            engine.timed(turn_after, None, reset=True)  # vLLM's cache as if it had kept the dialogue
            a = engine.timed(new, None, ANSWER_TOKENS)
            if r.result.num_cached_tokens != 0:
                raise RuntimeError(f"the recompute run reused {r.result.num_cached_tokens} tokens")
            if d.result.loaded_tokens == 0 or d.result.loaded_tokens != a.result.num_cached_tokens:
                raise RuntimeError(
                    f"DSS loaded {d.result.loaded_tokens} tokens, vLLM's warm cache reused "
                    f"{a.result.num_cached_tokens}: not the same prefix"
                )
            recompute.append(r.ttft_s)
            dss.append(d.ttft_s)
            apc.append(a.ttft_s)
            reused.append(d.result.loaded_tokens)
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
        n = engine.timed(nxt, engine.session(tenant, sid, TURNS + 2), ANSWER_TOKENS, reset=True)
        want_next = min((len(new) + len(out) - 1) // BS, (len(nxt) - 1) // BS) * BS
        if n.result.loaded_tokens != want_next:
            raise RuntimeError(f"the next turn loaded {n.result.loaded_tokens}, not {want_next}")
        store.check()
    finally:
        engine.close()
        served.close()

    print(f"rolled-back turn: context ~{len(new)} tokens, reused {reused} tokens")
    print(f"recompute {ms(recompute)}\ndss       {ms(dss)}\napc       {ms(apc)}")
    print(
        f"median TTFT: DSS {1000 * median(dss):.0f} ms, vLLM warm cache {1000 * median(apc):.0f} ms, "
        f"recompute {1000 * median(recompute):.0f} ms; next turn on the new path {1000 * n.ttft_s:.0f} ms "
        f"({n.result.loaded_tokens} tokens loaded)"
    )
    print(
        f"RESULT rollback_vs_apc={ratio(median(dss), median(apc)):.4f} "
        f"rollback_vs_recompute={ratio(median(dss), median(recompute)):.4f}"
    )


if __name__ == "__main__":
    main()
