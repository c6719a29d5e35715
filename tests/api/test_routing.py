"""What a router needs from a server: the session id as a header (`X-DSS-Session`, which a router
hashes on without parsing the body), the server's name on every answer (`X-DSS-Server`), and ids
that carry the route key the router chose (`X-DSS-Route`, `dss.dialogue.route_keys`).

Over a real engine-less `dss serve --dev` (sessions, errors, health), and one chat turn on the
shared real-engine server.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api_server import ApiServer, api_server, user_msg

__all__ = ["api_server"]  # the shared real-engine server (a fixture)

SERVER_ID = "alpha"


@pytest.fixture(scope="module")
def store_server() -> Iterator[ApiServer]:
    server = ApiServer(
        None,
        Path(tempfile.mkdtemp(prefix="dss-api-routing-")),
        dev=True,
        env={"DSS_STORE__SERVER_ID": SERVER_ID, "DSS_STORE__HOST_CAPACITY_BYTES": str(16 << 20)},
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def c(store_server: ApiServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=store_server.base_url, headers={"X-DSS-User": "rita"}, timeout=30) as client:
        yield client


def test_every_answer_names_its_server(c: httpx.Client) -> None:
    answers = [
        c.get("/healthz"),
        c.get("/readyz"),
        c.get("/v1/sessions"),
        c.get("/v1/no-such-route"),  # 404 from the router of routes
        c.post("/v1/sessions", content=b"{not json", headers={"Content-Type": "application/json"}),  # 400
        c.post("/v1/chat/completions", json={"messages": [user_msg("hi")]}),  # 503: no engine here
        c.post("/v1/sessions", content=b"x" * (9 << 20)),  # 413 from the body-limit middleware
    ]
    assert [r.status_code for r in answers] == [200, 200, 200, 404, 400, 503, 413]
    assert {r.headers.get("X-DSS-Server") for r in answers} == {SERVER_ID}


def test_the_header_names_the_session_when_the_body_does_not(c: httpx.Client) -> None:
    r = c.post("/v1/sessions", json={"system_prompt": "Be brief."}, headers={"X-DSS-Session": "hdr-1"})
    assert r.status_code == 201, r.text
    assert r.json()["id"] == "hdr-1"
    # The same id in both is one session id, not a conflict.
    r = c.post("/v1/sessions", json={"session_id": "hdr-2"}, headers={"X-DSS-Session": "hdr-2"})
    assert r.status_code == 201 and r.json()["id"] == "hdr-2"
    assert c.get("/v1/sessions/hdr-1").json()["system_prompt"] == "Be brief."


def test_a_header_and_a_body_that_differ_are_a_400_naming_session_id(c: httpx.Client) -> None:
    r = c.post("/v1/sessions", json={"session_id": "body-3"}, headers={"X-DSS-Session": "hdr-3"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "session_id_conflict")
    assert err["param"] == "session_id"
    assert "X-DSS-Session" in err["message"]
    assert [c.get(f"/v1/sessions/{sid}").status_code for sid in ("body-3", "hdr-3")] == [404, 404]


@pytest.mark.parametrize("bad", ["two words", "x" * 129, "a/b", ""])
def test_the_header_is_validated_like_the_body_field(c: httpx.Client, bad: str) -> None:
    by_header = c.post("/v1/sessions", json={}, headers={"X-DSS-Session": bad})
    by_body = c.post("/v1/sessions", json={"session_id": bad})
    assert (by_header.status_code, by_body.status_code) == (400, 400), (by_header.text, by_body.text)
    assert by_header.json()["error"]["param"] == "X-DSS-Session"
    assert by_body.json()["error"]["param"] == "session_id"
    assert by_header.json()["error"]["code"] == by_body.json()["error"]["code"] == "invalid_request"


ROUTE = "00c0ffee00c0ffee"


def test_a_conversation_id_carries_the_route_key_the_router_sent(c: httpx.Client) -> None:
    routed = c.post("/v1/conversations", json={}, headers={"X-DSS-Route": ROUTE})
    assert routed.status_code == 200, routed.text
    cid = routed.json()["id"]
    assert re.fullmatch(rf"conv_{ROUTE}[0-9a-f]{{32}}", cid), cid
    assert c.get(f"/v1/conversations/{cid}").status_code == 200
    assert c.get(f"/v1/sessions/{cid}").status_code == 200  # the session it is
    # Without the header, or with anything but 16 lowercase hex digits: a random route key.
    for headers in ({}, {"X-DSS-Route": "00C0FFEE00C0FFEE"}, {"X-DSS-Route": "short"}):
        other = c.post("/v1/conversations", json={}, headers=headers)
        assert other.status_code == 200, other.text
        assert re.fullmatch(r"conv_[0-9a-f]{48}", other.json()["id"]) and ROUTE not in other.json()["id"]


@pytest.mark.engine
def test_response_ids_carry_their_chains_route_key(api_server: ApiServer) -> None:
    """A new chain's response id (and its session's name) begins with the route key the router
    sent; a response continuing it keeps the chain's key whatever the header says (a request sent
    past the router too); a response in a conversation carries the conversation's."""
    body = {"model": "default", "max_output_tokens": 2, "temperature": 0}
    with api_server.client("route-rae") as h:
        first = h.post("/v1/responses", json={**body, "input": "Hi."}, headers={"X-DSS-Route": ROUTE})
        assert first.status_code == 200, first.text
        rid = first.json()["id"]
        assert re.fullmatch(rf"resp_{ROUTE}[0-9a-f]{{32}}", rid), rid
        sessions = [s["id"] for s in h.get("/v1/sessions").json()["data"]]
        assert [s for s in sessions if s.startswith("resp-")] == [next(s for s in sessions if ROUTE in s)]
        for headers in ({}, {"X-DSS-Route": "1111111111111111"}):
            nxt = h.post(
                "/v1/responses", json={**body, "input": "More.", "previous_response_id": rid}, headers=headers
            )
            assert nxt.status_code == 200, nxt.text
            assert nxt.json()["id"].startswith(f"resp_{ROUTE}"), nxt.json()["id"]
        cid = h.post("/v1/conversations", json={}, headers={"X-DSS-Route": "2222222222222222"}).json()["id"]
        in_conv = h.post("/v1/responses", json={**body, "input": "Hi.", "conversation": cid})
        assert in_conv.status_code == 200, in_conv.text
        assert in_conv.json()["id"].startswith("resp_2222222222222222"), in_conv.json()["id"]


@pytest.mark.engine
def test_a_chat_turn_takes_its_session_from_the_header(api_server: ApiServer) -> None:
    headers = {**api_server.headers("rhea"), "X-DSS-Session": "routed-chat"}
    with httpx.Client(base_url=api_server.base_url, headers=headers, timeout=180) as c:
        q1 = [user_msg("Name a colour.")]
        r1 = c.post("/v1/chat/completions", json={"messages": q1, "max_tokens": 4, "temperature": 0})
        assert r1.status_code == 200, r1.text
        first = r1.json()
        assert (first["session_id"], first["state_version"], first["branch"]) == ("routed-chat", 1, "main")
        assert r1.headers.get("X-DSS-Server")  # the store's server id (random, kept in the data dir)

        # state_version with the session only in the header.
        reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
        q2 = [*q1, reply, user_msg("Another?")]
        r2 = c.post("/v1/chat/completions", json={"messages": q2, "max_tokens": 4, "state_version": 1})
        assert r2.status_code == 200, r2.text
        assert (r2.json()["session_id"], r2.json()["parent_version"]) == ("routed-chat", 1)

        conflict = c.post(
            "/v1/chat/completions", json={"messages": q1, "max_tokens": 4, "session_id": "other-chat"}
        )
        assert conflict.status_code == 400 and conflict.json()["error"]["code"] == "session_id_conflict"
        versions = c.get("/v1/sessions/routed-chat/versions").json()["data"]
        assert [v["number"] for v in versions] == [1, 2]  # the refused turn committed nothing
        assert c.get("/v1/sessions/other-chat").status_code == 404

    no_session = httpx.post(
        api_server.base_url + "/v1/chat/completions",
        json={"messages": [user_msg("hi")], "max_tokens": 1, "state_version": 1},
        headers=api_server.headers("rhea"),
        timeout=60,
    )
    assert no_session.status_code == 400 and no_session.json()["error"]["param"] == "state_version"


@pytest.mark.pg
def test_a_database_outage_is_a_retryable_503(pg_url: str, tmp_path: Path) -> None:
    """PostgreSQL gone (here: its database dropped under the server) was a 500 internal_error; it
    is a 503 with Retry-After, so a client or a router retries (nothing was committed)."""
    server = ApiServer(None, tmp_path, dev=True, env={"DSS_STORE__DB_URL": pg_url})
    server.start()
    try:
        with httpx.Client(base_url=server.base_url, headers={"X-DSS-User": "rita"}, timeout=30) as c:
            assert c.post("/v1/sessions", json={"session_id": "before"}).status_code == 201
            from sqlalchemy import create_engine, text
            from sqlalchemy.engine import make_url

            url = make_url(pg_url)
            admin = create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE "{url.database}" WITH (FORCE)'))
            admin.dispose()
            for r in (c.get("/v1/sessions/before"), c.post("/v1/sessions", json={"session_id": "after"})):
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "database_unavailable"
                assert r.headers["Retry-After"] == "1"
    finally:
        server.stop()
