"""Chat through the real server: sessions, caching, streaming, rollback, branches, forks, limits.

Every test uses its own users, so the engine's prefix cache (salted per user) never links tests.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from tests.api_server import ApiServer, api_server, chat, sse_events, user_msg

pytestmark = [pytest.mark.engine, pytest.mark.slow]
__all__ = ["api_server"]

# About 330 tokens with the chat template: two full 128-token pages for DSS to store.
LONG_SYSTEM = (
    "You are a careful assistant for a small bakery called The Rolling Pin. "
    + " ".join(
        f"Rule {i}: answer politely, mention the bakery's {item} when it helps, and keep answers short."
        for i, item in enumerate(
            ["sourdough", "croissants", "rye bread", "cinnamon rolls", "baguettes", "muffins", "scones",
             "bagels", "brioche", "focaccia", "pretzels", "danishes", "eclairs", "macarons"]
        )
    )
)  # fmt: skip


def system(text: str = LONG_SYSTEM) -> dict[str, str]:
    return {"role": "system", "content": text}


def assistant(resp: dict[str, Any]) -> dict[str, str]:
    return {"role": "assistant", "content": resp["choices"][0]["message"]["content"]}


def cached(resp: dict[str, Any]) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


def post_message(client: httpx.Client, sid: str, content: str, **extra: Any) -> dict[str, Any]:
    body = {"content": content, "max_tokens": 12, "temperature": 0, **extra}
    r = client.post(f"/v1/sessions/{sid}/messages", json=body)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def test_multi_turn_is_cached_and_matches_a_cold_run(api_server: ApiServer) -> None:
    oa = api_server.openai("mt-alice")
    q1 = [system(), user_msg("Which bread do you recommend for sandwiches?")]
    r1 = oa.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=q1,
        max_tokens=16,
        temperature=0,
        extra_body={"session_id": "mt-1"},
    ).model_dump()
    assert r1["session_id"] == "mt-1" and r1["state_version"] == 1 and r1["branch"] == "main"
    assert r1["parent_version"] is None
    q2 = [*q1, assistant(r1), user_msg("And what goes well with coffee?")]
    r2 = oa.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=q2,
        max_tokens=16,
        temperature=0,
        extra_body={"session_id": "mt-1"},
    ).model_dump()
    assert r2["state_version"] == 2 and r2["parent_version"] == 1 and r2["branch"] == "main"
    assert cached(r2) >= 256, r2["usage"]
    assert r2["dss"]["cached_tokens"] == cached(r2)
    assert r2["dss"]["engine_cached_tokens"] + r2["dss"]["loaded_tokens"] == cached(r2)
    # The same prompt from another user starts cold and must produce the same text.
    cold = chat(api_server.client("mt-cold"), q2)
    assert cached(cold) == 0
    assert cold["choices"][0]["message"]["content"] == r2["choices"][0]["message"]["content"]
    assert "session_id" not in cold


def test_streaming_reports_usage_and_commits_after_the_last_token(api_server: ApiServer) -> None:
    c = api_server.client("st-bob")
    q1 = [system(), user_msg("Name one pastry.")]
    first = chat(c, q1, session_id="st-1")
    body = {
        "messages": [*q1, assistant(first), user_msg("Name another one.")],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "session_id": "st-1",
    }
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    finish = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["state_version"] == 2 and finish[0]["parent_version"] == 1
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    stored = c.get("/v1/sessions/st-1/versions/2").json()
    assert stored["messages"][-1] == {"role": "assistant", "content": text}

    # The official client sees the same stream, usage included.
    oa = api_server.openai("st-bob")
    stream = oa.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[system(), user_msg("Say hello.")],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = list(stream)
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens > 0
    assert any(p.choices and p.choices[0].finish_reason for p in parts)


def test_stateful_messages_continue_the_stored_dialogue(api_server: ApiServer) -> None:
    c = api_server.client("sm-carol")
    r = c.post(
        "/v1/sessions", json={"session_id": "sm-1", "system_prompt": LONG_SYSTEM, "metadata": {"k": 1}}
    )
    assert r.status_code == 201, r.text
    a1 = post_message(c, "sm-1", "What do you bake on Sundays?")
    assert a1["state_version"] == 1 and a1["object"] == "chat.completion"
    a2 = post_message(c, "sm-1", "Is it gluten free?")
    assert a2["state_version"] == 2 and a2["parent_version"] == 1 and a2["branch"] == "main"
    assert cached(a2) >= 256
    v2 = c.get("/v1/sessions/sm-1/versions/2").json()
    assert [m["role"] for m in v2["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert v2["messages"][1]["content"] == "What do you bake on Sundays?"
    assert v2["messages"][2]["content"] == a1["choices"][0]["message"]["content"]
    assert v2["messages"][4]["content"] == a2["choices"][0]["message"]["content"]
    listing = c.get("/v1/sessions/sm-1/versions").json()
    assert [v["number"] for v in listing["data"]] == [1, 2]
    assert listing["data"][1]["n_tokens"] > listing["data"][0]["n_tokens"] > 256
    assert sum(listing["data"][1]["resident"].values()) >= 256
    assert c.post("/v1/sessions/nope/messages", json={"content": "x"}).status_code == 404


def test_rollback_then_continue(api_server: ApiServer) -> None:
    c = api_server.client("rb-dave")
    c.post("/v1/sessions", json={"session_id": "rb-1", "system_prompt": LONG_SYSTEM})
    for q in ("First question?", "Second question?", "Third question?"):
        post_message(c, "rb-1", q)
    r = c.post("/v1/sessions/rb-1/rollback", json={"to_version": 1})
    assert r.status_code == 200 and r.json()["head_version"] == 1 and r.json()["name"] == "main"
    assert [v["number"] for v in c.get("/v1/sessions/rb-1/versions").json()["data"]] == [1, 2, 3]
    a4 = post_message(c, "rb-1", "A different second question?")
    assert a4["state_version"] == 4 and a4["parent_version"] == 1 and a4["branch"] == "main"
    assert cached(a4) >= 256
    v4 = c.get("/v1/sessions/rb-1/versions/4").json()
    assert v4["messages"][3]["content"] == "A different second question?" and len(v4["messages"]) == 5
    # Version 3 is no ancestor of the new head; a stale expected head conflicts; 99 does not exist.
    assert c.post("/v1/sessions/rb-1/rollback", json={"to_version": 3}).status_code == 409
    stale = c.post("/v1/sessions/rb-1/rollback", json={"to_version": 1, "expected_head": 2})
    assert stale.status_code == 409 and stale.json()["error"]["type"] == "conflict_error"
    assert c.post("/v1/sessions/rb-1/rollback", json={"to_version": 99}).status_code == 404
    assert c.post("/v1/sessions/rb-1/rollback", json={"to_version": 1, "branch": "zz"}).status_code == 404


def settled_stored_bytes(c: httpx.Client, sid: str, timeout_s: float = 15.0) -> int:
    """The session's `stored_bytes` once it stops changing: a turn's last pages are saved just
    after its answer is sent."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while True:
        now = c.get(f"/v1/sessions/{sid}").json()["stored_bytes"]
        if now == last or time.monotonic() > deadline:
            return int(now)
        last = now
        time.sleep(0.5)


def test_branch_then_continue_on_both(api_server: ApiServer) -> None:
    c = api_server.client("br-erin")
    c.post("/v1/sessions", json={"session_id": "br-1", "system_prompt": LONG_SYSTEM})
    assert c.get("/v1/sessions/br-1").json()["stored_bytes"] == 0  # no version, no KV
    post_message(c, "br-1", "Tell me about rye.")
    # One version: its pages (whole ones and the tail page), each stored once.
    v1_bytes = settled_stored_bytes(c, "br-1")
    v1_pages = -(-max(c.get("/v1/sessions/br-1/versions/1").json()["resident"].values()) // 128)
    page_bytes, rest = divmod(v1_bytes, v1_pages)
    assert page_bytes > 0 and rest == 0
    post_message(c, "br-1", "And spelt?")
    r = c.post("/v1/sessions/br-1/branches", json={"from_version": 1, "name": "alt"})
    assert r.status_code == 201 and r.json()["head_version"] == 1
    assert c.post("/v1/sessions/br-1/branches", json={"from_version": 2, "name": "alt"}).status_code == 409
    assert c.post("/v1/sessions/br-1/branches", json={"from_version": 9, "name": "x"}).status_code == 404
    on_alt = post_message(c, "br-1", "And oats?", branch="alt")
    assert (on_alt["state_version"], on_alt["parent_version"], on_alt["branch"]) == (3, 1, "alt")
    assert cached(on_alt) >= 256
    on_main = post_message(c, "br-1", "And barley?")
    assert (on_main["state_version"], on_main["parent_version"], on_main["branch"]) == (4, 2, "main")
    heads = {b["name"]: b["head_version"] for b in c.get("/v1/sessions/br-1/branches").json()["data"]}
    assert heads == {"main": 4, "alt": 3}
    session = c.get("/v1/sessions/br-1").json()
    assert session["version_count"] == 4 and {b["name"] for b in session["branches"]} == {"main", "alt"}
    # Four versions on two branches: the pages they share count once, so more than the longest
    # version's (v4) and less than all four versions' pages summed.
    total = settled_stored_bytes(c, "br-1")
    pages = [
        -(-max(c.get(f"/v1/sessions/br-1/versions/{n}").json()["resident"].values()) // 128)
        for n in range(1, 5)
    ]
    stored, rest = divmod(total, page_bytes)
    assert rest == 0 and max(pages) < stored < sum(pages), (stored, pages)
    listed = {x["id"]: x["stored_bytes"] for x in c.get("/v1/sessions").json()["data"]}
    assert listed["br-1"] == total


def test_edited_history_forks_and_state_version_is_checked(api_server: ApiServer) -> None:
    c = api_server.client("fk-fay")
    q1 = [system(), user_msg("What is a croissant?")]
    r1 = chat(c, q1, session_id="fk-1")
    r2 = chat(c, [*q1, assistant(r1), user_msg("How long to bake it?")], session_id="fk-1")
    assert r2["state_version"] == 2
    # The client edits its second question: the turn attaches to version 1, on a new branch.
    edited = chat(c, [*q1, assistant(r1), user_msg("How much butter is in it?")], session_id="fk-1")
    assert edited["parent_version"] == 1 and edited["state_version"] == 3
    assert edited["branch"] != "main"
    heads = {b["name"]: b["head_version"] for b in c.get("/v1/sessions/fk-1/branches").json()["data"]}
    assert heads["main"] == 2 and heads[edited["branch"]] == 3
    # state_version pins the parent: the messages must extend exactly that version.
    wrong = c.post(
        "/v1/chat/completions",
        json={"messages": [system(), user_msg("Unrelated")], "session_id": "fk-1", "state_version": 2},
    )
    assert wrong.status_code == 409, wrong.text
    missing = c.post(
        "/v1/chat/completions",
        json={"messages": q1, "session_id": "fk-1", "state_version": 42, "max_tokens": 4},
    )
    assert missing.status_code == 404
    pinned = chat(c, [*q1, assistant(r1), user_msg("Is it French?")], session_id="fk-1", state_version=1)
    assert pinned["parent_version"] == 1 and pinned["state_version"] == 4


def test_limits_and_bad_input(api_server: ApiServer) -> None:
    c = api_server.client("lim-gus")
    huge = "bread " * 2500  # over the 2,048-token context of the test server
    r = c.post("/v1/chat/completions", json={"messages": [user_msg(huge)], "max_tokens": 8})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "2048" in err["message"]
    r = c.post("/v1/chat/completions", json={"messages": [user_msg("hi")], "max_tokens": 10_000})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = c.post(
        "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = c.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    r = c.post("/v1/chat/completions", json={"messages": [user_msg("hi")], "model": "gpt-4"})
    assert r.status_code == 404
    # Nothing is silently dropped: an unknown field, or an attempt to pick a cache namespace, is a
    # 400 that names it.
    for extra, code in (
        ({"tenant": "public"}, "unrecognized_parameter"),
        ({"kv_transfer_params": {"tenant": "public", "session_id": "x"}}, "unsupported_parameter"),
        ({"cache_salt": "public"}, "unsupported_parameter"),
        ({"frobnicate": True}, "unrecognized_parameter"),
    ):
        r = c.post(
            "/v1/chat/completions", json={"messages": [user_msg("Say yes.")], "max_tokens": 4, **extra}
        )
        name = next(iter(extra))
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == name and r.json()["error"]["code"] == code
    # A refused field at its no-op value asks for nothing and passes.
    ok = chat(c, [user_msg("Say yes.")], max_tokens=4, echo=False)
    assert ok["choices"][0]["message"]["role"] == "assistant"


def test_disconnect_mid_stream_commits_nothing(api_server: ApiServer) -> None:
    c = api_server.client("dc-hal")
    q1 = [system(), user_msg("Say hi.")]
    chat(c, q1, session_id="dc-1", max_tokens=4)
    body = {
        "messages": [system(), user_msg("Write a very long story about bread, at least five paragraphs.")],
        "max_tokens": 64,
        "temperature": 0,
        "stream": True,
        "session_id": "dc-1",
    }
    seen_finish = False
    raw = httpx.Client(base_url=api_server.base_url, headers=api_server.headers("dc-hal"), timeout=60)
    with raw, raw.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                seen_finish |= bool(event["choices"] and event["choices"][0]["finish_reason"])
                n += 1
            if n >= 3:
                break
    # Leaving the block closed the connection mid-stream.
    assert not seen_finish
    time.sleep(3.0)
    session = c.get("/v1/sessions/dc-1").json()
    assert session["version_count"] == 1, session


def test_sixteen_concurrent_clients_without_errors_or_cross_talk(api_server: ApiServer) -> None:
    n = 16

    async def one(i: int) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]]]:
        user = f"cc-user-{i}"
        secret = f"The secret code of client {i} is {1000 + i * 7}."
        async with api_server.async_client(user) as c:
            msgs: list[dict[str, Any]] = [
                system(LONG_SYSTEM + " " + secret),
                user_msg(f"Client {i} says hello."),
            ]
            results = []
            for turn in range(2):
                r = await c.post(
                    "/v1/chat/completions",
                    json={"messages": msgs, "max_tokens": 6, "temperature": 0, "session_id": f"cc-{i}"},
                )
                assert r.status_code == 200, r.text
                data = r.json()
                assert data["session_id"] == f"cc-{i}" and data["state_version"] == turn + 1
                results.append(data)
                msgs = [*msgs, assistant(data), user_msg(f"Client {i} turn {turn + 2}.")]
            stored = (await c.get(f"/v1/sessions/cc-{i}/versions/2")).json()["messages"]
            return i, stored, msgs[:-1]

    async def main() -> list[tuple[int, list[dict[str, Any]], list[dict[str, Any]]]]:
        return await asyncio.gather(*(one(i) for i in range(n)))

    for i, stored, sent in asyncio.run(main()):
        assert stored == sent, f"client {i} stored dialogue differs from what it sent"
        assert f"client {i} is {1000 + i * 7}" in stored[0]["content"]
    # Each client sees exactly its own one session.
    for i in (0, n - 1):
        listing = api_server.client(f"cc-user-{i}").get("/v1/sessions").json()
        assert [s["id"] for s in listing["data"]] == [f"cc-{i}"]


def test_seeded_requests_whose_prefills_would_be_split_keep_the_engine_alive(api_server: ApiServer) -> None:
    """Three sampled requests with a `seed` and ~1,150-token prompts, sent together: their prefills
    did not fit one engine step together, vLLM split one, then rewound its seeded CPU generator
    (`set_offset`, which CPU generators lack), and the engine core died for everyone: 503
    "the engine died" to these and to every later request (found by bench/soak.py). On CPU the
    engine now runs whole prefills (`engine_patch.setup.factory`)."""

    def one(k: int) -> int:
        facts = " ".join(
            f"Shelf {j} of room {k} holds a brass compass from {1700 + j + k}." for j in range(60)
        )
        body = {
            "messages": [{"role": "system", "content": facts}, user_msg("Name one item.")],
            "seed": 17 + k,
            "temperature": 1.0,
            "max_tokens": 8,
        }
        with api_server.client("seeded-prefills") as c:
            return c.post("/v1/chat/completions", json=body, timeout=180).status_code

    async def together() -> list[int]:
        return list(await asyncio.gather(*(asyncio.to_thread(one, k) for k in range(3))))

    assert asyncio.run(together()) == [200, 200, 200]
    with api_server.client("seeded-prefills") as c:
        assert chat(c, [user_msg("Hi")], max_tokens=2)["choices"][0]["message"]["content"] is not None
