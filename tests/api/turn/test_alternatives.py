"""`n` alternatives in a session become sibling versions, each on a branch of its own, and any of
them can be continued with its whole history served from the store (real server)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api_server import ApiServer, api_server, chat, sse_events, user_msg

pytestmark = [pytest.mark.engine]
__all__ = ["api_server"]

SYSTEM = {"role": "system", "content": "You are a ship's cook. Answer in one short sentence."}
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 8}


def test_n_alternatives_are_sibling_versions_and_each_continues(api_server: ApiServer) -> None:
    c = api_server.client("alt-ann")
    q1 = [SYSTEM, user_msg("What is for breakfast?")]
    first = chat(c, q1, session_id="alt-1")
    history = [*q1, first["choices"][0]["message"]]
    q2 = [*history, user_msg("And for lunch?")]
    two = chat(c, q2, session_id="alt-1", n=2, **SAMPLED)
    choices = two["choices"]
    assert [ch["index"] for ch in choices] == [0, 1]
    assert [ch["state_version"] for ch in choices] == [2, 3]
    assert choices[0]["branch"] == "main" and choices[1]["branch"] not in ("main", None)
    assert two["state_version"] == 2 and two["parent_version"] == 1  # the first choice's, as before
    # OpenAI's counting: the prompt once, the choices' tokens summed.
    assert two["usage"]["prompt_tokens"] == chat(c, q2, max_tokens=1)["usage"]["prompt_tokens"]
    versions = {v["number"]: v for v in c.get("/v1/sessions/alt-1/versions").json()["data"]}
    assert versions[2]["parent"] == versions[3]["parent"] == 1
    assert versions[3]["branch"] == choices[1]["branch"]
    # Continue the second alternative: its whole history (shared prompt and its own answer) is
    # served, all but its last sampled token.
    alt = c.get("/v1/sessions/alt-1/versions/3").json()
    q3 = [*alt["messages"], user_msg("Thanks!")]
    cont = chat(c, q3, session_id="alt-1", state_version=3, max_tokens=4)
    assert cont["parent_version"] == 3 and cont["branch"] == choices[1]["branch"]
    assert cont["usage"]["prompt_tokens_details"]["cached_tokens"] >= alt["n_tokens"] - 1, cont["usage"]
    # And the first alternative still continues on main.
    main = c.get("/v1/sessions/alt-1/versions/2").json()
    cont0 = chat(c, [*main["messages"], user_msg("Thanks!")], session_id="alt-1", max_tokens=4)
    assert cont0["parent_version"] == 2 and cont0["branch"] == "main"
    assert cont0["usage"]["prompt_tokens_details"]["cached_tokens"] >= main["n_tokens"] - 1


def test_streamed_and_stateful_alternatives_commit_one_version_each(api_server: ApiServer) -> None:
    c = api_server.client("alt-bo")
    body: dict[str, Any] = {
        "messages": [SYSTEM, user_msg("What is for dinner?")],
        "session_id": "alt-2",
        "stream": True,
        "n": 3,
        **SAMPLED,
    }
    finals: dict[int, dict[str, Any]] = {}
    texts: dict[int, str] = {0: "", 1: "", 2: ""}
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for ev in sse_events(r.iter_lines()):
            if ev == "[DONE]" or not isinstance(ev, dict) or not ev["choices"]:
                continue
            ch = ev["choices"][0]
            texts[ch["index"]] += ch["delta"].get("content") or ""
            if ch["finish_reason"] is not None:
                finals[ch["index"]] = ch
    assert sorted(finals) == [0, 1, 2]
    assert sorted(f["state_version"] for f in finals.values()) == [1, 2, 3]
    assert len({f["branch"] for f in finals.values()}) == 3  # main and two forks
    for i, f in finals.items():
        v = c.get(f"/v1/sessions/alt-2/versions/{f['state_version']}").json()
        assert v["messages"][-1]["content"] == texts[i] and v["parent"] is None
    # The stateful route: two alternatives on main; the first advances main, the other forks.
    r = c.post("/v1/sessions/alt-2/messages", json={"content": "And dessert?", "n": 2, **SAMPLED})
    assert r.status_code == 200, r.text
    out = r.json()["choices"]
    assert out[0]["branch"] == "main" and out[1]["branch"] != "main"
    branches = {b["name"]: b["head_version"] for b in c.get("/v1/sessions/alt-2/branches").json()["data"]}
    assert (
        branches["main"] == out[0]["state_version"] and branches[out[1]["branch"]] == out[1]["state_version"]
    )
    # Stateful mode continues the stored dialogue: `messages` would be dropped, so it is refused.
    r = c.post("/v1/sessions/alt-2/messages", json={"content": "x", "messages": [user_msg("y")], **SAMPLED})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    # n beyond the server's limit is refused before anything runs.
    r = c.post("/v1/sessions/alt-2/messages", json={"content": "x", "n": 9, **SAMPLED})
    assert r.status_code == 400 and r.json()["error"]["code"] == "limit_exceeded"
