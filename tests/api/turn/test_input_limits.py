"""Hostile input cannot poison reads (issue 19, item 9) nor add per-step cost to every request in
the batch (item 10): the depth and size of every stored free-form JSON value, and the length of
vLLM's per-request lists, are bounded by the limits table before anything is written or generated.

Engine-less: the generating routes run with a stand-in engine that fails the test if a request
reaches it (the limits are checked first, so a refused request never does)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from api.http_errors import BadRequest
from api.llm.slots import GenerationSlots
from dss.db.connect import transaction
from dss.db.models import SessionRow
from dss.dialogue.response_store import ResponseRecord, ResponseStore, new_response_id
from dss.dialogue.versions import VersionStore
from dss.errors import JsonTooDeep, JsonTooLarge
from dss.jsonlimits import MAX_SERVABLE_DEPTH, JsonLimits, check_json, json_depth
from tests.api.test_unit import DEV, as_user, settings_for, started, state_of


def deep(levels: int) -> dict[str, Any]:
    """`{"a": {"a": ...}}`, `levels` objects deep."""
    out: dict[str, Any] = {}
    for _ in range(levels - 1):
        out = {"a": out}
    return out


def error_of(r: Any) -> dict[str, Any]:
    err: dict[str, Any] = r.json()["error"]
    return err


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = settings_for(tmp_path / "data", auth=DEV, limits={"max_json_bytes": 8192})
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield started(c)


# ---------------------------------------------------------------------------------- the validator
def test_depth_is_measured_without_recursion() -> None:
    assert json_depth(1, 10)[0] == 0 and json_depth({}, 10)[0] == 1 and json_depth([[]], 10)[0] == 2
    assert json_depth({"x": [1, {"y": []}]}, 10) == (4, (".x", "[1]", ".y"))
    # Far past Python's recursion limit: still measured (and the walk stops past the limit).
    assert json_depth(deep(50_000), 64)[0] == 65
    with pytest.raises(JsonTooDeep) as exc:
        check_json("metadata", deep(100_000), JsonLimits(max_depth=64))
    assert exc.value.field == "metadata" and "max_json_depth=64" in str(exc.value)
    with pytest.raises(JsonTooLarge):
        check_json("metadata", {"k": "x" * 2000}, JsonLimits(max_bytes=1000))
    assert check_json("metadata", deep(64), JsonLimits(max_depth=64)) > 0


# ------------------------------------------------------------------------------- session metadata
def test_deep_metadata_is_refused_and_nothing_is_committed(client: TestClient) -> None:
    """It was answered 500 after the row was committed; a retry got 409, and every read of the
    user's sessions failed from then on."""
    h = as_user("mallory")
    r = client.post("/v1/sessions", json={"session_id": "deep", "metadata": deep(300)}, headers=h)
    assert r.status_code == 400, r.text
    assert error_of(r)["code"] == "json_too_deep" and error_of(r)["param"] == "metadata"
    assert client.get("/v1/sessions", headers=h).json()["data"] == []
    r = client.post("/v1/sessions", json={"session_id": "deep", "metadata": deep(64)}, headers=h)
    assert r.status_code == 201, r.text  # the id was never taken
    r = client.get("/v1/sessions", headers=h)
    assert r.status_code == 200 and [s["id"] for s in r.json()["data"]] == ["deep"]
    r = client.post("/v1/sessions", json={"metadata": deep(65)}, headers=h)
    assert r.status_code == 400 and error_of(r)["param"] == "metadata"


def test_metadata_over_max_json_bytes_is_refused(client: TestClient) -> None:
    r = client.post("/v1/sessions", json={"metadata": {"k": "x" * 9000}}, headers=as_user("u"))
    assert r.status_code == 400, r.text
    assert error_of(r)["code"] == "json_too_large" and error_of(r)["param"] == "metadata"
    assert "max_json_bytes=8192" in error_of(r)["message"]


def test_deep_metadata_already_stored_does_not_break_reads(client: TestClient) -> None:
    """A row written before the limit existed (as the old code did): the user's listing and the
    session itself still answer, with the unservable metadata left out."""
    h = as_user("olduser")
    for sid in ("fine", "poisoned"):
        r = client.post("/v1/sessions", json={"session_id": sid, "metadata": {"k": 1}}, headers=h)
        assert r.status_code == 201
    with transaction(state_of(client).store.sf) as db:
        db.execute(update(SessionRow).where(SessionRow.id == "poisoned").values(meta=deep(300)))
    r = client.get("/v1/sessions", headers=h)
    assert r.status_code == 200, r.text
    assert {s["id"]: s["metadata"] for s in r.json()["data"]} == {"fine": {"k": 1}, "poisoned": {}}
    r = client.get("/v1/sessions/poisoned", headers=h)
    assert r.status_code == 200 and r.json()["metadata"] == {}
    assert client.delete("/v1/sessions/poisoned", headers=h).status_code == 200


# ---------------------------------------------------------------------------- the store's writes
def test_store_refuses_deep_tool_calls_and_response_parts_before_writing(
    session_factory: sessionmaker[Session],
) -> None:
    limits = JsonLimits(max_depth=16, max_bytes=4096)
    versions = VersionStore(session_factory, json_limits=limits)
    responses = ResponseStore(session_factory, versions, limits)
    versions.create_session("u", "s")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", "x": deep(20)}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(JsonTooDeep) as exc:
        versions.commit("u", "s", tokens=[1, 2, 3], messages=messages)
    assert exc.value.field == "messages[1].tool_calls"
    assert versions.get_session("u", "s").version_count == 0  # nothing committed
    with pytest.raises(JsonTooDeep):
        versions.create_session("u", "s2", metadata=deep(17))
    with pytest.raises(JsonTooLarge):
        versions.create_session("u", "s2", metadata={"k": "x" * 5000})
    v = versions.commit("u", "s", tokens=[1, 2, 3], messages=messages[:1])

    def rec(**changes: Any) -> ResponseRecord:
        base: dict[str, Any] = {
            "id": new_response_id(),
            "user": "u",
            "session_id": "s",
            "version": v.number,
            "previous_response_id": None,
            "created_at": datetime.now(UTC),
            "model": "m",
            "status": "completed",
            "instructions": None,
            "input_items": [{"type": "message", "role": "user", "content": "hi"}],
            "output": [],
            "usage": {},
            "params": {"text": {"format": {"type": "text"}}},
        }
        return ResponseRecord(**(base | changes))

    with pytest.raises(JsonTooDeep) as exc:
        responses.add(rec(params={"text": {"format": {"type": "json_schema", "schema": deep(20)}}}))
    assert exc.value.field == "text"
    parts = [{"type": "input_text", "text": "t", "annotations": [deep(20)]}]
    with pytest.raises(JsonTooDeep) as exc:
        responses.add(rec(input_items=[{"type": "message", "role": "user", "content": parts}]))
    assert exc.value.field == "input[0].content"
    responses.add(rec())  # within the limits
    assert versions.check() == [] and responses.check() == []


# ------------------------------------------------------------------- the generating routes (items 9, 10)
class _NoEngine:
    """Stands in for the engine: admits (real slots), but a request that gets as far as vLLM's
    validation fails the test (`reached_engine`): the limits are checked before it."""

    model_names = ("m",)
    model_name = "m"

    def __init__(self) -> None:
        self.slots = GenerationSlots(8, 1)

    def validate(self, *_: Any, **__: Any) -> Any:
        raise BadRequest("the request reached the engine", code="reached_engine")


@pytest.fixture
def gen(client: TestClient) -> Iterator[TestClient]:
    state = state_of(client)
    state.engine = _NoEngine()  # type: ignore[assignment]
    try:
        yield client
    finally:
        state.engine = None


CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("field", "value", "setting"),
    [
        ("logit_bias", {str(i): 1.0 for i in range(301)}, "max_logit_bias"),
        ("allowed_token_ids", list(range(1025)), "max_allowed_token_ids"),
        ("stop_token_ids", list(range(65)), "max_stop_token_ids"),
        ("bad_words", [f"w{i}" for i in range(65)], "max_bad_words"),
        ("tools", [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)], "max_tools"),
    ],
)
def test_per_request_lists_are_bounded(gen: TestClient, field: str, value: Any, setting: str) -> None:
    h = as_user("u")
    r = gen.post(CHAT, json={"messages": USER, field: value}, headers=h)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == field and setting in error_of(r)["message"], r.text
    assert gen.post("/v1/sessions", json={"session_id": "s"}, headers=h).status_code == 201
    r = gen.post("/v1/sessions/s/messages", json={"content": "hi", field: value}, headers=h)
    assert r.status_code == 400 and error_of(r)["param"] == field, r.text
    # At the limit the request goes on (here: to the stand-in engine).
    ok = value[: len(value) - 1] if isinstance(value, list) else dict(list(value.items())[:-1])
    r = gen.post(CHAT, json={"messages": USER, field: ok}, headers=h)
    assert error_of(r)["code"] == "reached_engine", r.text


def test_deep_json_of_a_turn_is_refused_before_generating(gen: TestClient) -> None:
    h = as_user("u")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}, "x": deep(300)}
    messages = [*USER, {"role": "assistant", "content": "", "tool_calls": [call]}, *USER]
    r = gen.post(CHAT, json={"messages": messages, "session_id": "t"}, headers=h)
    assert r.status_code == 400 and error_of(r)["param"] == "messages[1].tool_calls", r.text
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": deep(300)}}
    r = gen.post(CHAT, json={"messages": USER, "response_format": fmt}, headers=h)
    assert r.status_code == 400 and error_of(r)["param"] == "response_format", r.text
    text = {"format": {"type": "json_schema", "name": "x", "schema": deep(300)}}
    r = gen.post("/v1/responses", json={"input": "hi", "text": text}, headers=h)
    assert r.status_code == 400 and error_of(r)["param"] == "text", r.text
    parts = [{"type": "input_text", "text": "hi", "annotations": [deep(300)]}]
    r = gen.post("/v1/responses", json={"input": [{"role": "user", "content": parts}]}, headers=h)
    assert r.status_code == 400 and error_of(r)["param"] == "input[0].content", r.text
    plain = {"format": {"type": "json_object"}}
    r = gen.post("/v1/responses", json={"input": "hi", "text": plain}, headers=h)
    assert error_of(r)["code"] == "reached_engine", r.text
    assert gen.get("/v1/sessions", headers=h).json()["data"] == []  # nothing stored


def test_the_deepest_allowed_metadata_is_served(tmp_path: Path) -> None:
    """`max_json_depth` stops below what the response serialiser can nest (pydantic-core refuses
    ~255 levels; a listing wraps the metadata in four of its own)."""
    settings = settings_for(tmp_path / "data", auth=DEV, limits={"max_json_depth": MAX_SERVABLE_DEPTH})
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        started(c)
        h = as_user("u")
        r = c.post("/v1/sessions", json={"session_id": "d", "metadata": deep(MAX_SERVABLE_DEPTH)}, headers=h)
        assert r.status_code == 201, r.text
        r = c.get("/v1/sessions", headers=h)
        assert (
            r.status_code == 200
            and json_depth(r.json()["data"][0]["metadata"], 1000)[0] == MAX_SERVABLE_DEPTH
        )
        assert c.get("/v1/sessions/d", headers=h).status_code == 200
