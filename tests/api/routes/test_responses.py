"""The OpenAI Responses API on DSS versions, through the official `openai` client against the real
server: deletion with descendants, streaming, `store: false`, erasure. Chains and forks across a
restart are in tests/api/test_restart.py (one restart of the shared server for both APIs)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.api_server import ApiServer, api_server

pytestmark = [pytest.mark.engine]
__all__ = ["api_server"]

INSTRUCTIONS = "You answer questions about the Carrow valley railway. " + " ".join(
    f"Station {i} is named {name} and opened in {1880 + i}."
    for i, name in enumerate(["Ashby", "Brill", "Cotter", "Dunmore", "Elwick", "Fenton", "Garth", "Hale"])
)


def ask(client: Any, text: str, previous: str | None = None, **extra: Any) -> Any:
    return client.responses.create(
        model="default",
        input=text,
        instructions=INSTRUCTIONS,
        previous_response_id=previous,
        max_output_tokens=6,
        temperature=0,
        **extra,
    )


def dss(resp: Any) -> dict[str, Any]:
    info: dict[str, Any] = resp.model_extra["dss"]
    return info


def test_delete_says_what_it_does_to_descendants(api_server: ApiServer) -> None:
    c = api_server.openai("resp-bo")
    h = api_server.client("resp-bo")
    r1 = ask(c, "Name one station.")
    r2 = ask(c, "Name another.", r1.id)
    side = ask(c, "Name a third.", r1.id)  # a fork at r1
    # An ancestor is not deleted silently: 409 naming what continues from it.
    with pytest.raises(openai.ConflictError) as err:
        c.responses.delete(r1.id)
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "response_has_descendants"
    assert r2.id in body["message"] and side.id in body["message"]
    assert c.responses.retrieve(r1.id).id == r1.id
    # A leaf goes with its version; its sibling branch is untouched.
    gone = h.delete(f"/v1/responses/{side.id}")
    assert gone.status_code == 200 and gone.json()["deleted_response_ids"] == [side.id]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(side.id)
    assert c.responses.retrieve(r2.id).output_text == r2.output_text
    assert ask(c, "One more.", r2.id).previous_response_id == r2.id
    # cascade deletes the response, everything that continues it, and their versions.
    gone = h.delete(f"/v1/responses/{r1.id}", params={"cascade": "true"})
    assert gone.status_code == 200, gone.text
    assert gone.json()["deleted_response_ids"][0] == r1.id and r2.id in gone.json()["deleted_response_ids"]
    for rid in (r1.id, r2.id):
        assert h.get(f"/v1/responses/{rid}").status_code == 404


def test_stream_input_items_store_false_and_refused_fields(api_server: ApiServer) -> None:
    c = api_server.openai("resp-cy")
    h = api_server.client("resp-cy")
    first = ask(c, "Which station is the oldest?")
    with c.responses.stream(
        model="default",
        input=[{"role": "user", "content": "And which is the newest?"}],
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    stored = c.responses.retrieve(final.id)
    assert stored.output_text == final.output_text and stored.status == "incomplete"
    assert final.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1
    items = c.responses.input_items.list(final.id)
    assert [i.role for i in items.data] == ["user"] and items.data[0].content[
        0
    ].text == "And which is the newest?"
    # store: false answers and keeps nothing.
    r = h.post("/v1/responses", json={"input": "Say hi.", "store": False, "max_output_tokens": 3})
    assert r.status_code == 200 and r.json()["store"] is False, r.text
    assert h.get(f"/v1/responses/{r.json()['id']}").status_code == 404
    # What the Responses API defines and DSS does not serve is a 400 naming it, never dropped.
    for extra, code in (
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "unsupported_parameter"),
        ({"reasoning": {"effort": "high"}}, "unsupported_parameter"),
        ({"frobnicate": 1}, "unrecognized_parameter"),
    ):
        r = h.post("/v1/responses", json={"input": "x", "max_output_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
        assert r.json()["error"]["param"] == next(iter(extra))
    # A session header names a Chat Completions session: refused, not dropped in silence.
    for header in ("X-DSS-Session", "X-Session-ID"):
        r = h.post("/v1/responses", json={"input": "x", "max_output_tokens": 2}, headers={header: "s1"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "session_header_not_supported", r.text
        assert r.json()["error"]["param"] == header
    r = h.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_" + "0" * 48})
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


def test_responses_are_erased_with_their_user(api_server: ApiServer) -> None:
    c = api_server.openai("resp-dee")
    r1 = ask(c, "Which station is the oldest?")
    r2 = ask(c, "And the newest?", r1.id)
    # Another user never sees a response, even by its id.
    other = httpx.get(
        f"{api_server.base_url}/v1/responses/{r1.id}", headers=api_server.headers("resp-eve"), timeout=30
    )
    assert other.status_code == 404 and other.json()["error"]["code"] == "response_not_found"
    admin = api_server.client("admin", admin=True)
    receipt = admin.delete("/v1/users/resp-dee")
    assert receipt.status_code == 200, receipt.text
    assert receipt.json()["counts"]["responses"] == 2
    assert receipt.json()["verification"]["remnants"] == 0
    h = api_server.client("resp-dee")
    for rid in (r1.id, r2.id):
        assert h.get(f"/v1/responses/{rid}").status_code == 404
