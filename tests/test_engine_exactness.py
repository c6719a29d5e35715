"""A cache must never change an answer: greedy outputs through DSS equal cold outputs, token for token.

One real vLLM CPU engine on the default model serves the whole module. "Cold" is plain vLLM (no
session info) after emptying vLLM's own prefix cache; "DSS" is the same prompt in its session
after emptying vLLM's prefix cache, so every reused token comes from the store.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from dss.store import Store
from dss.types import PUBLIC_TENANT
from engine_patch.fingerprint import frontend_fingerprint
from tests.engine_helpers import Engine, Result, make_conversations, open_store, session, words

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BS = 128  # the CPU backend's default block size


@dataclass
class Rig:
    store: Store
    engine: Engine


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    store = open_store(Path(tmp_path_factory.mktemp("dss-exact")), host_gib=2.0)
    address, authkey = store.serve_rpc()
    engine = Engine(address, authkey)
    try:
        yield Rig(store, engine)
    finally:
        engine.close()
        store.close()


def dss_then_cold(
    engine: Engine, prompts: list[list[int]], sessions: list[dict[str, object]], max_tokens: list[int]
) -> tuple[list[Result], list[Result]]:
    engine.reset_prefix_cache()
    dss = engine.generate(prompts, sessions, max_tokens)
    engine.reset_prefix_cache()
    cold = engine.generate(prompts, [None] * len(prompts), max_tokens)
    return dss, cold


def expected_loaded(prev_prompt: list[int], prev_output: list[int], prompt: list[int]) -> int:
    """Pages the previous turn saved (its computed tokens: all but the last sampled one), capped
    so at least one prompt token is left to compute."""
    saved_pages = (len(prev_prompt) + len(prev_output) - 1) // BS
    return min(saved_pages, (len(prompt) - 1) // BS) * BS


def test_multiturn_conversations_are_token_identical(rig: Rig) -> None:
    engine, tenant = rig.engine, rig.store.tenant_for("exactness-user")
    convs = make_conversations(20)
    assert any(len(engine.chat_ids(c.first)) > 3 * BS for c in convs)
    prompts = [engine.chat_ids(c.first) for c in convs]
    prev: list[tuple[list[int], list[int]] | None] = [None] * len(convs)
    divergences: list[str] = []
    loaded_wrong: list[str] = []
    compared = 0
    for turn in range(max(len(c.followups) for c in convs) + 1):
        active = [i for i, c in enumerate(convs) if turn <= len(c.followups)]
        dss, cold = dss_then_cold(
            engine,
            [prompts[i] for i in active],
            [session(tenant, convs[i].session_id, turn + 1) for i in active],
            [convs[i].max_tokens for i in active],
        )
        for i, d, c in zip(active, dss, cold, strict=True):
            compared += 1
            assert c.params is None and c.num_cached_tokens == 0, "a cold run must not hit any cache"
            assert d.params is not None and d.params["session_id"] == convs[i].session_id
            if d.output_ids != c.output_ids:
                divergences.append(f"{convs[i].name} turn {turn + 1}: {d.text!r} != {c.text!r}")
            p = prev[i]
            want = expected_loaded(p[0], p[1], prompts[i]) if p is not None else 0
            if d.loaded_tokens != want:
                loaded_wrong.append(
                    f"{convs[i].name} turn {turn + 1}: loaded {d.loaded_tokens}, expected {want}"
                )
            if turn < len(convs[i].followups):
                prev[i] = (prompts[i], c.output_ids)
                prompts[i] = engine.continue_ids(prompts[i], c.output_ids, convs[i].followups[turn])
    print(
        f"\nexactness: {len(convs)} conversations, {compared} turns compared, {len(divergences)} divergences"
    )
    assert not divergences, "\n".join(divergences)
    assert not loaded_wrong, "\n".join(loaded_wrong)


def test_rollback_and_branch_then_continue(rig: Rig) -> None:
    engine, store = rig.engine, rig.store
    tenant = store.tenant_for("rollback-user")
    rng = np.random.default_rng(11)
    sid = "rollback-session"
    # Build a 4-turn history through DSS (saving every turn).
    prompt = engine.chat_ids([{"role": "user", "content": f"Remember these words: {words(rng, 260)}"}])
    states: list[tuple[list[int], list[int]]] = []
    for turn in range(4):
        engine.reset_prefix_cache()
        (r,) = engine.generate([prompt], [session(tenant, sid, turn + 1)], 20)
        states.append((prompt, r.output_ids))
        prompt = engine.continue_ids(prompt, r.output_ids, f"Tell me more about {words(rng, 30)}")

    cases: list[tuple[str, list[int], dict[str, object], int]] = []
    # Rollback: back to the state after turn 2, then a different question, same session.
    p2, o2 = states[1]
    rolled = engine.continue_ids(p2, o2, f"Instead, describe {words(rng, 25)}")
    cases.append(("rollback", rolled, session(tenant, sid, 5), expected_loaded(p2, o2, rolled)))
    # Branch: a new session forked at turn 1 of the same user's dialogue.
    p1, o1 = states[0]
    branched = engine.continue_ids(p1, o1, f"Let us talk about {words(rng, 40)} instead")
    cases.append(
        ("branch", branched, session(tenant, "branch-session", 1), expected_loaded(p1, o1, branched))
    )

    for name, ids, sess, want in cases:
        (d,), (c,) = dss_then_cold(engine, [ids], [sess], [24])
        assert d.output_ids == c.output_ids, f"{name}: {d.text!r} != {c.text!r}"
        assert d.loaded_tokens == want > 0, f"{name}: loaded {d.loaded_tokens}, expected {want}"
        # ...and continue one more turn on the new path.
        nxt = engine.continue_ids(ids, c.output_ids, f"And finally {words(rng, 20)}")
        (d2,), (c2,) = dss_then_cold(engine, [nxt], [sess], [24])
        assert d2.output_ids == c2.output_ids, f"{name} + 1: {d2.text!r} != {c2.text!r}"
        assert d2.loaded_tokens == expected_loaded(ids, c.output_ids, nxt) > 0


def test_request_without_session_is_plain_vllm(rig: Rig) -> None:
    engine, store = rig.engine, rig.store
    rng = np.random.default_rng(5)
    ids = engine.chat_ids([{"role": "user", "content": f"Plain request: {words(rng, 300)}"}])
    pages_before = store.stats()["pages"]
    engine.reset_prefix_cache()
    (a,) = engine.generate([ids], [None], 16)
    engine.reset_prefix_cache()
    (b,) = engine.generate([ids], [{"kv_transfer_params": {"session_id": "no-tenant"}}], 16)
    assert a.params is None and b.params is None
    assert a.num_cached_tokens == b.num_cached_tokens == 0
    assert a.output_ids == b.output_ids
    assert store.stats()["pages"] == pages_before, "a request without a session must not be saved"


def test_tenants_are_isolated_and_public_prefix_is_shared(rig: Rig) -> None:
    engine, store = rig.engine, rig.store
    (fid,) = store.fingerprints
    assert frontend_fingerprint(engine.llm.llm_engine.vllm_config).id == fid
    rng = np.random.default_rng(3)

    # Private prompts are never shared between users.
    private = engine.chat_ids([{"role": "user", "content": f"My secret notes: {words(rng, 400)}"}])
    (alice,), _ = dss_then_cold(engine, [private], [session(store.tenant_for("alice"), "a1")], [8])
    engine.reset_prefix_cache()
    (bob,) = engine.generate([private], [session(store.tenant_for("bob"), "b1")], [8])
    assert bob.loaded_tokens == 0 and bob.num_cached_tokens == 0
    assert bob.output_ids == alice.output_ids

    # An admin-registered public system prompt is shared, and only that part.
    system = [{"role": "system", "content": f"Company policy: {words(rng, 330)}"}]
    carol_ids = engine.chat_ids([*system, {"role": "user", "content": f"Carol asks {words(rng, 200)}"}])
    system_only = engine.chat_ids(system)
    common = next(i for i, (a, b) in enumerate(zip(system_only, carol_ids, strict=False)) if a != b)
    public = carol_ids[: (common // BS) * BS]
    assert len(public) >= 2 * BS
    store.register_public_prefix(fid, public, text="policy", pin=True)
    engine.reset_prefix_cache()
    (warm,) = engine.generate([public], [session(PUBLIC_TENANT, "admin-warmup")], [1])
    assert warm.params is not None and warm.params["stored_pages"] == len(public) // BS

    (carol,), (carol_cold,) = dss_then_cold(
        engine, [carol_ids], [session(store.tenant_for("carol"), "c1")], [16]
    )
    assert carol.loaded_tokens == len(public)
    assert carol.output_ids == carol_cold.output_ids
    # Dave sends Carol's exact prompt: he gets the public pages, never Carol's private ones.
    engine.reset_prefix_cache()
    (dave,) = engine.generate([carol_ids], [session(store.tenant_for("dave"), "d1")], [16])
    assert dave.loaded_tokens == len(public)
    assert dave.output_ids == carol_cold.output_ids
    # Carol herself, next time, gets her private pages too.
    engine.reset_prefix_cache()
    (carol2,) = engine.generate([carol_ids], [session(store.tenant_for("carol"), "c1", 2)], [16])
    assert carol2.loaded_tokens == ((len(carol_ids) - 1) // BS) * BS > len(public)
    assert carol2.output_ids == carol_cold.output_ids
    store.check()
