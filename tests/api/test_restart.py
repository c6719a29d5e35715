"""Restart: stop the real server, start it again on the same data directory. What each API built
before survives, and its next turn is served from the store (the host arena and the engine's own
cache died with the process).

One restart of the shared server (an engine start, ~35 s on 2 cores) serves every scenario: a
session's next turn read from the disk tier, a Responses API chain with a fork whose responses
survive and whose branches both continue from their stored KV, and a conversation (Conversations
API) whose items keep their ids and whose next response is served from the store
(tests/api/routes/test_conversations_over_http.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.api.routes.test_conversations_over_http import conversation_after, conversation_before
from tests.api.routes.test_responses import ask, dss
from tests.api_server import ApiServer, api_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]
__all__ = ["api_server"]

SYSTEM = "You are the archivist of a railway museum. " + " ".join(
    f"Exhibit {i}: locomotive number {300 + i} built in {1890 + i} ran the {i}th northern line."
    for i in range(26)
)


# --------------------------------------------------------------------------- a session (/v1/sessions)
def session_before(client: httpx.Client) -> None:
    created = client.post("/v1/sessions", json={"session_id": "rs-1", "system_prompt": SYSTEM})
    assert created.status_code == 201, created.text
    for q in ("Which locomotive is the oldest?", "And which is the newest?"):
        r = client.post("/v1/sessions/rs-1/messages", json={"content": q, "max_tokens": 10, "temperature": 0})
        assert r.status_code == 200, r.text
    before = client.get("/v1/sessions/rs-1/versions").json()["data"][-1]
    assert sum(before["resident"].values()) >= 256


def session_after(client: httpx.Client) -> None:
    after = client.get("/v1/sessions/rs-1/versions").json()["data"]
    assert [v["number"] for v in after] == [1, 2]
    assert after[-1]["resident"]["host"] == 0 and after[-1]["resident"]["disk"] >= 256, after[-1]
    r = client.post(
        "/v1/sessions/rs-1/messages", json={"content": "Who built them?", "max_tokens": 10, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["state_version"] == 3 and data["parent_version"] == 2
    info = data["dss"]
    # Nothing was in the new engine's cache: every cached token came from DSS, read from disk.
    assert info["engine_cached_tokens"] == 0 and info["loaded_tokens"] >= 256, info
    assert info["loaded_from"]["disk"] >= 256 and info["resident"]["host"] == 0, info
    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == info["loaded_tokens"]


# ------------------------------------------------------------------ a response chain (/v1/responses)
@dataclass
class Chain:
    responses: list[Any]  # r1..r4 on main
    fork: Any  # continues r2: a branch at its version
    session: str


def chain_before(c: Any) -> Chain:
    r1 = ask(c, "Which station is the oldest?")
    r2 = ask(c, "And the newest?", r1.id)
    r3 = ask(c, "Which one opened in 1883?", r2.id)
    r4 = ask(c, "How many stations are there?", r3.id)
    chain = [r1, r2, r3, r4]
    assert all(r.id.startswith("resp_") and r.object == "response" for r in chain)
    assert [r.previous_response_id for r in chain] == [None, r1.id, r2.id, r3.id]
    session = dss(r1)["session_id"]
    assert [dss(r)["session_id"] for r in chain] == [session] * 4
    assert [dss(r)["version"] for r in chain] == [1, 2, 3, 4]
    assert {dss(r)["branch"] for r in chain} == {"main"}
    # Each turn after the first found its whole history stored: all but the last sampled token,
    # which has no KV until the next turn computes it.
    for prev, r in itertools.pairwise(chain):
        assert r.usage.input_tokens_details.cached_tokens == prev.usage.total_tokens - 1, r.usage

    # Continuing an older response forks: a new branch at its version; the chain stays intact.
    fork = ask(c, "Which station opened last?", r2.id)
    assert fork.previous_response_id == r2.id
    assert dss(fork)["version"] == 5 and dss(fork)["branch"] not in ("main", None)
    # (at least: the chain's next turn there began with the same template tokens)
    assert fork.usage.input_tokens_details.cached_tokens >= r2.usage.total_tokens - 1
    got = c.responses.retrieve(r4.id)
    assert got.output_text == r4.output_text and got.previous_response_id == r3.id
    return Chain(chain, fork, session)


def chain_after(c: Any, before: Chain) -> None:
    r4 = before.responses[-1]
    for r in (*before.responses, before.fork):  # every response survived
        assert c.responses.retrieve(r.id).output_text == r.output_text
    for tip in (r4, before.fork):  # both branches continue with their KV read back from the store
        nxt = ask(c, "Thank you.", tip.id)
        info = dss(nxt)
        cached = nxt.usage.input_tokens_details.cached_tokens
        assert cached >= tip.usage.total_tokens - 1, nxt.usage
        if tip is r4:  # the new engine's cache was empty: every cached token came from DSS
            assert info["loaded_tokens"] == cached, info
        else:  # the pages both branches share are in the engine's cache now; the fork's are not
            assert 0 < info["loaded_tokens"] < cached, info
        assert info["session_id"] == before.session


def test_sessions_and_response_chains_continue_from_the_store_after_a_restart(api_server: ApiServer) -> None:
    with api_server.client("rs-jo") as client:
        session_before(client)
    chain = chain_before(api_server.openai("resp-ann"))
    conversation = conversation_before(api_server.openai("conv-rs"))

    api_server.restart()  # graceful: the store flushes write-through and closes

    with api_server.client("rs-jo") as client:
        session_after(client)  # first: its turn must find the new engine's cache empty
    # That turn's load (pages promoted from disk) was planned by the API's store before the
    # request went to the engine, which asked the store nothing for it.
    metrics = api_server.client("admin", admin=True).get("/metrics").text
    (line,) = [m for m in metrics.splitlines() if m.startswith("dss_kv_loads_planned_ahead_total ")]
    assert float(line.split()[1]) >= 1, line
    chain_after(api_server.openai("resp-ann"), chain)
    conversation_after(api_server.openai("conv-rs"), conversation)
