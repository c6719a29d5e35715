"""A turn in flight when its user is erased keeps nothing (issue 19, item 4), through the API with
a stand-in for vLLM: the real routes, `ChatEngine` and store, a tokenizer that can hold a turn
while its prompt is being rendered, and an `AsyncLLM` that answers at once.

Only generations already running were stopped by an erasure; a turn still being prepared went on
after it, and a first Responses turn then re-created its session with content sent before the
erasure. Every write of a turn is now fenced by the erasure epoch the turn was admitted under.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.llm.chat_engine import ChatEngine
from tests.api.test_unit import DEV, as_user, settings_for, started, state_of
from tests.api_server import ApiServer, api_server
from tests.db_helpers import count_user_rows

__all__ = ["api_server"]


class HeldTokenizer:
    """Renders messages as plain text, one token per character; while `gate` is set, a render
    signals `entered` and waits for the gate (a turn held while its prompt is prepared)."""

    def __init__(self) -> None:
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **_: Any
    ) -> str:
        gate = self.gate
        if gate is not None:
            self.entered.set()
            assert gate.wait(30)
        text = "".join(f"<{m['role']}>{m.get('content') or ''}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) for ch in text]

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        return "".join(chr(i) for i in ids)


class InstantLLM:
    """`AsyncLLM` as `ChatEngine` uses it: every choice answers "ok" at once."""

    errored = False

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        comps = [
            SimpleNamespace(
                index=i,
                text="ok",
                token_ids=[111, 107],
                logprobs=None,
                finish_reason="stop",
                stop_reason=None,
            )
            for i in range(params.n)
        ]
        yield SimpleNamespace(outputs=comps, num_cached_tokens=0, kv_transfer_params=None)

    async def abort(self, ids: Sequence[str]) -> None:
        return None

    def shutdown(self) -> None:
        return None


@pytest.fixture
def held(tmp_path: Path) -> Iterator[tuple[TestClient, HeldTokenizer]]:
    with TestClient(create_app(settings_for(tmp_path / "data", auth=DEV))) as c:
        started(c)
        tokenizer = HeldTokenizer()
        state_of(c).engine = ChatEngine(
            InstantLLM(),
            tokenizer,
            model_name="stand-in",
            max_model_len=4096,
            fingerprint=None,
            max_inflight=4,
            retry_after_s=1,
            tag_key=b"k" * 32,
        )
        yield c, tokenizer


TURNS: dict[str, tuple[str, dict[str, Any]]] = {
    # A first Responses turn: its commit creates the session (this one survived the erasure).
    "responses": ("/v1/responses", {"input": "my secret", "max_output_tokens": 4}),
    # A chat turn in a session, with two alternatives (each one a version).
    "chat-n2": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "my secret"}], "session_id": "s1", "n": 2, "max_tokens": 4},
    ),
    # The stateful turn of an existing session.
    "messages": ("/v1/sessions/s1/messages", {"content": "my secret", "max_tokens": 4}),
}


@pytest.mark.parametrize("kind", sorted(TURNS))
def test_a_turn_being_prepared_when_its_user_is_erased_keeps_nothing(
    held: tuple[TestClient, HeldTokenizer], kind: str
) -> None:
    c, tokenizer = held
    user = f"inflight-{kind}"
    headers = as_user(user)
    path, body = TURNS[kind]
    if kind == "messages":
        assert c.post("/v1/sessions", json={"session_id": "s1"}, headers=headers).status_code == 201
    answers: list[Any] = []
    tokenizer.gate = threading.Event()
    turn = threading.Thread(
        target=lambda: answers.append(c.post(path, json=body, headers=headers)), daemon=True
    )
    turn.start()
    try:
        assert tokenizer.entered.wait(30), "the turn never reached its prompt"
        erased = c.delete(f"/v1/users/{user}", headers=headers)
        assert erased.status_code == 200, erased.text
    finally:
        tokenizer.gate.set()
        turn.join(30)
    assert answers, "the turn did not answer"
    store = state_of(c).store
    # Nothing the turn sent before the erasure was kept: no session, version or response.
    assert count_user_rows(store.sf, user) == {
        "sessions": 0,
        "versions": 0,
        "branches": 0,
        "responses": 0,
    }
    assert c.get("/v1/sessions", headers=headers).json()["data"] == []
    receipt = erased.json()
    if receipt["held_nothing"]:
        # A first turn: nothing of the user was stored yet, so no receipt; the epoch moved all the same.
        assert kind == "responses", receipt
    else:
        again = c.get(f"/v1/erasures/{receipt['id']}", headers=headers).json()
        assert again["verification"]["remnants"] == 0, again["verification"]["details"]
    # And the turn was told so.
    answer = answers[0]
    assert answer.status_code == 409, answer.text
    assert answer.json()["error"]["code"] == "user_erased"
    # The user, re-created, is served as usual.
    tokenizer.gate = None
    if kind == "messages":
        assert c.post("/v1/sessions", json={"session_id": "s1"}, headers=headers).status_code == 201
    again_turn = c.post(path, json=body, headers=headers)
    assert again_turn.status_code == 200, again_turn.text


@pytest.mark.engine
@pytest.mark.slow
def test_responses_in_flight_through_the_engine_keep_nothing_after_the_erasure(api_server: ApiServer) -> None:
    """The same through `dss serve` and vLLM: first Responses turns, each past its preparation
    (its stream has started), when their user is erased. Each one ends stored before the
    erasure (then erased with it), stopped, or refused at its commit: afterwards the user has no
    session and none of the responses exists."""
    user = "inflight-engine"
    body = {"model": "default", "input": "Count from one to twenty.", "stream": True, "max_output_tokens": 24}
    ids: list[str] = []
    ends: list[str] = []
    started_streams = threading.Semaphore(0)

    def stream() -> None:
        with api_server.client(user).stream("POST", "/v1/responses", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                if ev["type"] == "response.created":
                    ids.append(ev["response"]["id"])
                    started_streams.release()
                elif ev["type"] in ("response.completed", "error"):
                    ends.append(ev["type"] if ev["type"] != "error" else ev["code"])

    streams = [threading.Thread(target=stream, daemon=True) for _ in range(3)]
    for t in streams:
        t.start()
    for _ in streams:
        assert started_streams.acquire(timeout=120)
    erased = api_server.client(user).delete(f"/v1/users/{user}")
    assert erased.status_code == 200, erased.text
    for t in streams:
        t.join(120)
        assert not t.is_alive()
    assert len(ends) == 3 and set(ends) <= {"response.completed", "user_erased", "erased_during_generation"}
    client = api_server.client(user)
    assert client.get("/v1/sessions").json()["data"] == []
    assert all(client.get(f"/v1/responses/{rid}").status_code == 404 for rid in ids)
    receipt = api_server.client("admin", admin=True).get(f"/v1/erasures/{erased.json()['id']}").json()
    assert receipt["verification"]["remnants"] == 0, receipt["verification"]["details"]
