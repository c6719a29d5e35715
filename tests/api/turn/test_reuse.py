"""Every turn pays only for its new tokens, through the real server: a session's next turn
reuses everything the previous one computed, whatever its answer's ids tokenize back to, and
however far into a page it ended.

`cached_tokens` counts prompt tokens served from a cache (vLLM's own or DSS). The previous turn
computed all of its tokens but the last one it sampled (that one has no KV yet), so full reuse is
`prompt_tokens + completion_tokens - 1` of the previous turn.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api_server import ApiServer, api_server, chat, model_dir, user_msg

pytestmark = [pytest.mark.engine, pytest.mark.slow]
__all__ = ["api_server"]


def cached(resp: dict[str, Any]) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


def computed(resp: dict[str, Any]) -> int:
    """Tokens of the turn whose KV its engine computed: all but the last one sampled."""
    return int(resp["usage"]["prompt_tokens"] + resp["usage"]["completion_tokens"] - 1)


def answer_of(resp: dict[str, Any]) -> dict[str, str]:
    return {"role": "assistant", "content": resp["choices"][0]["message"]["content"]}


def rendered_length(messages: list[dict[str, str]]) -> int:
    from transformers import AutoTokenizer

    path = model_dir()
    assert path is not None
    tok = AutoTokenizer.from_pretrained(str(path))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tok.encode(text, add_special_tokens=False))


def test_sampled_answers_whose_ids_do_not_round_trip_are_reused_whole(api_server: ApiServer) -> None:
    """With sampling, answers often hold ids their text does not tokenize back to. Re-rendered
    from text, the next prompt differed from the stored tokens inside the answer, and everything
    from that page on was recomputed (`cached_tokens: 0` when it happened in the first page)."""
    c = api_server.client("reuse-sampled")
    q1 = [user_msg("Write two sentences about a river in spring.")]
    found_divergent = 0
    for seed in range(16):
        sid = f"rs-{seed}"
        r1 = chat(c, q1, session_id=sid, temperature=1.5, seed=seed, max_tokens=48)
        q2 = [*q1, answer_of(r1), user_msg("Shorter, please.")]
        r2 = chat(c, q2, session_id=sid, max_tokens=4)
        assert r2["parent_version"] == 1
        if r2["usage"]["prompt_tokens"] != rendered_length(q2):
            found_divergent += 1  # its stored ids are not what its text tokenizes to
        assert cached(r2) >= computed(r1), (seed, r1["usage"], r2["usage"], r2["dss"])
        if found_divergent:
            break
    assert found_divergent, "no sampled answer had ids that do not round-trip: the test proved nothing"


def test_a_history_shorter_than_a_page_is_reused(api_server: ApiServer) -> None:
    """The engine's pages hold 128 tokens: a first turn of ~40 tokens used to leave nothing to
    store, and every later turn ended its reuse at the last whole page."""
    c = api_server.client("reuse-short")
    q1 = [user_msg("Hi!")]
    r1 = chat(c, q1, session_id="short-1", max_tokens=8)
    assert computed(r1) < 128
    q2 = [*q1, answer_of(r1), user_msg("Tell me a fact.")]
    r2 = chat(c, q2, session_id="short-1", max_tokens=8)
    assert cached(r2) >= computed(r1), (r1["usage"], r2["usage"], r2["dss"])
    assert r2["dss"]["loaded_tokens"] > 0  # the tail page came from DSS (vLLM caches whole blocks only)


def test_every_turn_of_a_long_chat_reuses_the_whole_history(api_server: ApiServer) -> None:
    c = api_server.client("reuse-long")
    messages = [user_msg("Plan a day in Paris.")]
    prev: dict[str, Any] | None = None
    for i, follow_up in enumerate(["Make it cheaper.", "Add a museum.", "Now for two people."]):
        resp = chat(c, messages, session_id="long-1", max_tokens=60)
        if prev is not None:
            assert cached(resp) >= computed(prev), (i, prev["usage"], resp["usage"], resp["dss"])
        prev = resp
        messages = [*messages, answer_of(resp), user_msg(follow_up)]


def test_an_answer_the_client_sends_back_trimmed_continues_its_version(api_server: ApiServer) -> None:
    """Open WebUI keeps every answer with the whitespace around it stripped and sends it back so.
    Before: such a turn matched no stored version and became a new root (`parent_version` None)."""
    c = api_server.client("reuse-trimmed")
    q1 = [user_msg("List three colours, one per line.")]
    r1 = chat(c, q1, session_id="trim-1", max_tokens=24)
    text = r1["choices"][0]["message"]["content"]
    # What such a frontend sends: the answer trimmed, or (already trimmed) with a newline after it.
    sent = text.strip() if text != text.strip() else text + "\n"
    r2 = chat(c, [*q1, {"role": "assistant", "content": sent}, user_msg("Thanks!")], session_id="trim-1")
    assert (r2["parent_version"], r2["branch"]) == (r1["state_version"], "main"), r2
    assert r2["dss"]["echoed_answers"] == 1
    assert cached(r2) >= computed(r1), (r1["usage"], r2["usage"], r2["dss"])
    stored = c.get(f"/v1/sessions/trim-1/versions/{r2['state_version']}").json()
    assert stored["messages"][1]["content"] == text  # the answer as generated, as the model saw it


def test_the_stateful_messages_route_continues_from_stored_tokens(api_server: ApiServer) -> None:
    c: httpx.Client = api_server.client("reuse-messages")
    assert c.post("/v1/sessions", json={"session_id": "msg-1"}).status_code == 201
    first = c.post(
        "/v1/sessions/msg-1/messages", json={"content": "Name a color.", "max_tokens": 30, "temperature": 0}
    ).json()
    second = c.post(
        "/v1/sessions/msg-1/messages", json={"content": "Another.", "max_tokens": 4, "temperature": 0}
    ).json()
    assert cached(second) >= computed(first), (first["usage"], second["usage"])
