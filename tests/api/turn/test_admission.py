"""Admission and vanished clients, against the real server and engine with two generation slots.

Before: a streaming request took its slot only once its body began, after its 200 was promised,
so a burst of streams all passed the check and ran past `max_inflight`; and a non-streaming
request kept generating to its last token after its client was gone.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import pytest

from tests.api_server import ApiServer, small_api_server, user_msg

pytestmark = [pytest.mark.engine]
__all__ = ["small_api_server"]

SLOTS = 2  # DSS_ENGINE__MAX_INFLIGHT of the "small" server (one user may hold 1: half)
# DSS_SERVER__SEND_TIMEOUT_S of the "small" server is 2 s; the rest is the time the stream takes
# to fill the socket buffers (~25 s on a loaded 2-core machine).
STALL_BOUND_S = 90.0
# Greedy and long: the model writes all 400 tokens (many seconds on a CPU), outlasting the burst.
STORY = "Write a very long story about a dragon who learns to cook. Make it long."
LONG = {
    "messages": [user_msg(STORY)],
    "temperature": 0,
    "max_tokens": 400,
}


def gauge(server: ApiServer, name: str) -> float:
    text = server.client("admin", admin=True).get("/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


def wait_idle(server: ApiServer, within_s: float) -> float:
    """Seconds until no generation runs; fails after `within_s`."""
    began = time.monotonic()
    while gauge(server, "dss_generations_inflight") != 0:
        assert time.monotonic() - began < within_s, "generations still running"
        time.sleep(0.05)
    return time.monotonic() - began


def burst(server: ApiServer, requests: list[tuple[str, str, dict[str, object]]]) -> tuple[list[int], float]:
    """Send every streaming request (user, path, body) at once, hold each open at its status
    line, read how many generations run, then disconnect them all. Returns the status codes and
    that count. Retry-After is the server's on every refusal (503 and 429 alike)."""
    n = len(requests)

    async def run() -> tuple[list[tuple[int, str | None]], float]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        client = httpx.AsyncClient(base_url=server.base_url, timeout=60, limits=limits)
        async with client as c:
            # Connections first, so that the requests reach the server together.
            await asyncio.gather(*(c.get("/healthz") for _ in range(n)))
            opened = [
                c.stream("POST", path, json=body, headers=server.headers(user))
                for user, path, body in requests
            ]
            # All sent at once, each held open at its status line: admitted streams keep generating.
            responses = await asyncio.gather(*(o.__aenter__() for o in opened))
            statuses = [(r.status_code, r.headers.get("retry-after")) for r in responses]
            running = await asyncio.to_thread(gauge, server, "dss_generations_inflight")
            for o in opened:
                await o.__aexit__(None, None, None)  # disconnect: the streams stop
            return statuses, running

    statuses, running = asyncio.run(run())
    assert all(ra == "3" for s, ra in statuses if s in (429, 503)), statuses
    return sorted(s for s, _ in statuses), running


# The old check let a burst through whenever several requests passed it in one turn of the event
# loop, before any of their streams began: most bursts of this size, not all (6 of 8 in a trial),
# hence several rounds. Now every round is exact.
@pytest.mark.parametrize("burst_round", [1, 2, 3, 4])
def test_a_burst_of_streams_gets_exactly_the_excess_refused(
    small_api_server: ApiServer, burst_round: int
) -> None:
    server = small_api_server
    wait_idle(server, 60)
    n = SLOTS + 14
    # One user each: a user's own burst stops at their share of the slots (the next test).
    requests = [(f"adm-burst-{i}", "/v1/chat/completions", {**LONG, "stream": True}) for i in range(n)]
    codes, running = burst(server, requests)
    assert codes == [200] * SLOTS + [503] * (n - SLOTS)
    assert running == SLOTS


def test_the_stateful_route_takes_its_slot_on_arrival_too(small_api_server: ApiServer) -> None:
    """`/v1/sessions/{sid}/messages` shares the chat route's admission: before, its streams took
    their slots only once their bodies began, and a burst ran past the limit."""
    server = small_api_server
    wait_idle(server, 60)
    n = SLOTS + 10
    for i in range(n):
        c = server.client(f"adm-stateful-{i}")
        assert c.post("/v1/sessions", json={"session_id": f"adm-s{i}"}).status_code == 201
    body = {"content": STORY, "max_tokens": 400, "temperature": 0, "stream": True}
    codes, running = burst(
        server, [(f"adm-stateful-{i}", f"/v1/sessions/adm-s{i}/messages", body) for i in range(n)]
    )
    assert codes == [200] * SLOTS + [503] * (n - SLOTS)
    assert running == SLOTS


def test_one_users_burst_takes_only_their_share_of_the_slots(small_api_server: ApiServer) -> None:
    """Issue 28: one user's burst took every generation slot, and everyone else got 503s until
    it ended. Now a user holds at most `max_slots_per_user` (here 1 of 2): the rest of their
    burst gets 429 `too_many_user_generations`, and another user's request is still admitted."""
    server = small_api_server
    wait_idle(server, 60)
    stream = {**LONG, "stream": True}
    n = 6
    codes, running = burst(
        server,
        [("adm-greedy", "/v1/chat/completions", stream)] * n
        + [("adm-other", "/v1/chat/completions", stream)],
    )
    assert codes == [200, 200] + [429] * (n - 1)
    assert running == SLOTS
    r = server.client("adm-greedy").post("/v1/chat/completions", json={**LONG, "max_tokens": 1})
    assert r.status_code == 200, r.text  # the share came back with the burst's end
    assert gauge(server, "dss_generations_rejected_user_share_total") >= n - 1


def test_a_stream_whose_client_stops_reading_gives_its_slot_back(small_api_server: ApiServer) -> None:
    """Issue 28: a client that opened a stream and stopped reading held its generation slot (and
    its generation) for as long as it stayed connected. Now the connection is aborted once the
    server's writes have stalled for `send_timeout_s`, and the stream stops as for a client that
    left: the slot comes back, the generation is aborted, nothing is committed."""
    server = small_api_server
    wait_idle(server, 60)
    c = server.client("adm-stall")
    assert c.post("/v1/sessions", json={"session_id": "stall"}).status_code == 201
    aborted = gauge(server, "dss_generations_aborted_total")
    # Each token's chunk carries 20 alternatives with their log-probabilities (~1.6 kB), in 8
    # sampled choices: megabytes within a few hundred tokens, past what the socket buffers take
    # (~1.7 MB on loopback).
    body = {
        "messages": [user_msg(STORY)],
        "session_id": "stall",
        "stream": True,
        "n": 8,
        "temperature": 1.0,
        "seed": 1,
        "max_tokens": 512,
        "logprobs": True,
        "top_logprobs": 20,
    }
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nAuthorization: Bearer {server.key('adm-stall')}\r\n\r\n"
    )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(head.encode() + payload)
        status_line = sock.recv(64)  # the stream's first bytes; nothing is read after them
        assert status_line.startswith(b"HTTP/1.1 200"), status_line
        # Never read: the slot must come back within the generation's time plus the bound.
        took = wait_idle(server, STALL_BOUND_S)
    assert took < STALL_BOUND_S
    assert gauge(server, 'dss_connections_cut_total{reason="send_timeout"}') >= 1
    assert gauge(server, "dss_generations_aborted_total") == aborted + 1
    assert c.get("/v1/sessions/stall/versions").json()["data"] == []  # nothing committed


def test_a_vanished_client_stops_its_generation(small_api_server: ApiServer) -> None:
    server = small_api_server
    wait_idle(server, 60)
    c = server.client("adm-gone")
    assert c.post("/v1/sessions", json={"session_id": "gone"}).status_code == 201
    aborted = gauge(server, "dss_generations_aborted_total")
    body = {**LONG, "session_id": "gone"}
    with pytest.raises(httpx.ReadTimeout):
        # The client gives up while the answer is generated (hundreds of tokens: many seconds).
        httpx.post(
            server.base_url + "/v1/chat/completions",
            json=body,
            headers=server.headers("adm-gone"),
            timeout=2.0,
        )
    assert wait_idle(server, 3.0) < 3.0  # stopped at once, not after its 400th token
    assert gauge(server, "dss_generations_aborted_total") == aborted + 1
    assert c.get("/v1/sessions/gone/versions").json()["data"] == []  # nothing committed
    # The server serves on, slots free.
    r = c.post("/v1/chat/completions", json={**LONG, "max_tokens": 4, "session_id": "gone"})
    assert r.status_code == 200 and r.json()["state_version"] == 1, r.text
