"""Slow and hostile clients (issue 28), over real HTTP against `dss serve --no-engine`.

Before: uvicorn gave a connection unlimited time to send its request head (a socket that sent
half a request line, or nothing, was held forever); a response whose client stopped reading kept
its connection, and the response's task, for as long as the client stayed connected; and every
request with an unknown `dss-` token cost a database query, however often it was repeated.
"""

from __future__ import annotations

import re
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import event

from api.keys import api_keys
from api.keys.api_keys import ApiKeys
from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, upgrade_to_head
from tests.api_server import ApiServer

HEADER_TIMEOUT_S = 1.0
SEND_TIMEOUT_S = 1.0
# Loopback: the kernel takes ~1.7 MB of a response a client does not read before the server's
# writes stall (uvicorn's own buffer adds 64 KiB); a response well over that stalls for sure.
BIG_RESPONSE = 3_600_000
PROMPT_CHARS = 900_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    srv = ApiServer(
        None,
        tmp_path_factory.mktemp("slow-clients"),
        env={
            "DSS_SERVER__HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
            "DSS_SERVER__SEND_TIMEOUT_S": str(SEND_TIMEOUT_S),
        },
    )
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def metric(srv: ApiServer, name: str, labels: str = "") -> float:
    text = srv.client("admin", admin=True).get("/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m is not None else 0.0


def closed_within(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closes `sock` (reading and dropping whatever it sends), or None
    when it is still open after `limit_s`."""
    began = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - began < limit_s:
        try:
            if not sock.recv(65536):
                return time.monotonic() - began
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - began
    return None


@pytest.mark.parametrize("sent", [b"", b"GET /healthz HT", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"])
def test_a_connection_that_never_finishes_its_request_head_is_closed(server: ApiServer, sent: bytes) -> None:
    cut = metric(server, "dss_connections_cut_total", '{reason="header_timeout"}')
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(sent)
        took = closed_within(sock, HEADER_TIMEOUT_S + 5.0)
    assert took is not None, "the connection is still open"
    assert HEADER_TIMEOUT_S * 0.8 <= took <= HEADER_TIMEOUT_S + 2.0, took
    assert metric(server, "dss_connections_cut_total", '{reason="header_timeout"}') == cut + 1


def test_a_slow_but_steady_request_head_is_not_cut(server: ApiServer) -> None:
    """The bound is on the whole head, from its first byte: a head sent in pieces within it is
    answered, and a keep-alive connection's second request gets its own bound."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        for _ in range(2):
            for piece in (b"GET /healthz HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
                sock.sendall(piece)
                time.sleep(HEADER_TIMEOUT_S / 4)
            answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200"), answer


def test_a_client_that_stops_reading_its_response_is_cut(server: ApiServer) -> None:
    """A response larger than the socket buffers, to a client that never reads: once the
    server's writes have stalled for `send_timeout_s` the connection is aborted (before: it was
    held, and the response's task with it, until the client left)."""
    c = server.client("slow-reader")
    for i in range(BIG_RESPONSE // PROMPT_CHARS):  # the list answers every session's prompt
        r = c.post("/v1/sessions", json={"session_id": f"big-{i}", "system_prompt": "y" * PROMPT_CHARS})
        assert r.status_code == 201, r.text
    cut = metric(server, "dss_connections_cut_total", '{reason="send_timeout"}')
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
        sock.connect(("127.0.0.1", server.port))
        auth_line = f"Authorization: Bearer {server.key('slow-reader')}"
        sock.sendall(f"GET /v1/sessions?limit=20 HTTP/1.1\r\nHost: x\r\n{auth_line}\r\n\r\n".encode())
        deadline = time.monotonic() + SEND_TIMEOUT_S + 10.0
        while metric(server, "dss_connections_cut_total", '{reason="send_timeout"}') == cut:
            assert time.monotonic() < deadline, "the stalled response was not cut"
            time.sleep(0.2)
        # Now read: the response ends short of its whole body (the connection was aborted).
        received = 0
        sock.settimeout(5.0)
        try:
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            pass
    assert received < BIG_RESPONSE, received


def test_repeated_unknown_keys_cost_one_database_query(server: ApiServer) -> None:
    """An unknown `dss-` token is remembered for a few seconds: a client that repeats it gets its
    401 without a database query each time. A token that is not a DSS key at all costs none."""
    before = {o: metric(server, "dss_api_key_lookups_total", f'{{outcome="{o}"}}') for o in OUTCOMES}
    bad = "dss-" + secrets.token_urlsafe(32)
    with httpx.Client(base_url=server.base_url, timeout=10) as c:
        for _ in range(20):
            r = c.get("/v1/sessions", headers={"Authorization": f"Bearer {bad}"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        for _ in range(5):
            r = c.get("/v1/sessions", headers={"Authorization": "Bearer sk-not-a-dss-key"})
            assert r.status_code == 401, r.text
    after = {o: metric(server, "dss_api_key_lookups_total", f'{{outcome="{o}"}}') for o in OUTCOMES}
    assert {o: after[o] - before[o] for o in OUTCOMES} == {
        "unknown": 1,
        "remembered_unknown": 19,
        "not_a_key": 5,
        "found": 0,
    }
    # A key created since is not held back by the remembered unknown tokens.
    assert server.client("fresh-user").get("/v1/sessions").status_code == 200


OUTCOMES = ("found", "unknown", "remembered_unknown", "not_a_key")


def test_the_unknown_key_memory_is_bounded_expires_and_yields_to_a_new_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted at the database itself (every statement the engine executes)."""
    url = sqlite_url_for(tmp_path)
    upgrade_to_head(url)
    engine = make_engine(url)
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    now = [1000.0]
    try:
        keys = ApiKeys(make_session_factory(engine), unknown_ttl_s=5.0, unknown_max=3, clock=lambda: now[0])
        bad = ["dss-" + secrets.token_urlsafe(32) for _ in range(4)]
        assert keys.authenticate(bad[0]) is None
        queries = len(statements)
        assert queries >= 1
        for _ in range(10):
            assert keys.authenticate(bad[0]) is None
        assert len(statements) == queries  # remembered: no query
        now[0] += 5.1  # expired: asked again
        assert keys.authenticate(bad[0]) is None and len(statements) > queries
        for b in bad:  # four unknown tokens in a memory of three: the oldest is forgotten
            keys.authenticate(b)
        queries = len(statements)
        assert keys.authenticate(bad[3]) is None and len(statements) == queries
        assert keys.authenticate(bad[0]) is None and len(statements) > queries
        # A key made in this process is never answered from the memory of unknown tokens, even
        # one whose token was tried before it existed (made here with a token fixed in advance).
        fixed = secrets.token_urlsafe(32)
        assert keys.authenticate("dss-" + fixed) is None
        monkeypatch.setattr(api_keys.secrets, "token_urlsafe", lambda n: fixed)
        made = keys.create("alice")
        assert made.key == "dss-" + fixed
        caller = keys.authenticate(made.key)
        assert caller is not None and caller.user == "alice"
    finally:
        engine.dispose()


def test_a_users_share_of_the_slots_comes_back_with_each_slot() -> None:
    from api.http_errors import EngineOverloaded, UserSlotsExhausted
    from api.llm.slots import GenerationSlots
    from api.settings import EngineGroup

    assert [EngineGroup(max_inflight=n).slots_per_user for n in (1, 2, 3, 64)] == [1, 1, 1, 32]
    assert EngineGroup(max_inflight=4, max_slots_per_user=9).slots_per_user == 4
    slots = GenerationSlots(limit=3, retry_after_s=2, per_user=2)
    a1, a2 = slots.admit("alice"), slots.admit("alice")
    with pytest.raises(UserSlotsExhausted) as refused:
        slots.admit("alice")
    assert refused.value.status == 429 and refused.value.code == "too_many_user_generations"
    b = slots.admit("bob")
    with pytest.raises(EngineOverloaded):
        slots.admit("carol")
    a1.release()
    a1.release()  # once only
    assert (slots.inflight, slots.held_by) == (2, {"alice": 1, "bob": 1})
    a3 = slots.admit("alice")
    for s in (a2, a3, b):
        s.release()
    assert (slots.inflight, slots.held_by) == (0, {})
