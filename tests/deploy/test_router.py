"""The shipped router configuration (deploy/haproxy.cfg through deploy/cluster.py) in front of two
real engine-less `dss serve`, on loopback.

Each server has its own SQLite database here, so a session created through the router exists on
one server only: a later request for it that answers 200 also proves it reached that server.
The servers name themselves in `X-DSS-Server`. Skipped only when haproxy cannot be installed.
"""

from __future__ import annotations

import http.server
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deploy.haproxy import ensure_haproxy
from deploy.launcher import Cluster
from deploy.spec import ClusterError, ServerSpec
from tests.api_server import free_port

CHECK_INTERVAL_MS = 500
DEV_USER = {"X-DSS-User": "alice"}


@pytest.fixture(scope="module")
def haproxy() -> str:
    try:
        return ensure_haproxy()
    except ClusterError as exc:
        pytest.skip(f"haproxy cannot be installed here: {exc}")


@pytest.fixture(scope="module")
def cluster(haproxy: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("cluster")
    servers = [ServerSpec(name, i + 1, free_port(), work / name) for i, name in enumerate("ab")]
    c = Cluster(
        servers=servers,
        work_dir=work,
        router_port=free_port(),
        db_url=None,
        redis_url=None,
        engine=False,
        env={"DSS_STORE__HOST_CAPACITY_BYTES": str(16 << 20), "DSS_STORE__FSYNC": "false"},
        check_interval_ms=CHECK_INTERVAL_MS,
        haproxy=haproxy,
    )
    with c:
        c.start(ready_timeout_s=60)
        yield c


def served_by(r: httpx.Response) -> str:
    assert r.status_code < 500, r.text
    return r.headers["X-DSS-Server"]


def server_of(client: httpx.Client, sid: str) -> str:
    return served_by(client.get("/v1/sessions", headers={"X-DSS-Session": sid}))


def test_a_session_sticks_to_one_server_and_sessions_spread(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.router_url, headers=DEV_USER, timeout=10) as c:
        where = {f"stick-{i}": server_of(c, f"stick-{i}") for i in range(20)}
        for _ in range(3):
            assert {sid: server_of(c, sid) for sid in where} == where
    assert set(where.values()) == {"a", "b"}
    assert min(list(where.values()).count(n) for n in "ab") >= 3  # not all but a stray one on one side


def test_the_router_keys_on_the_header_the_body_field_and_the_path(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.router_url, headers=DEV_USER, timeout=10) as c:
        for sid in ("keyed-1", "keyed-2", "keyed-3", "keyed-4"):
            home = server_of(c, sid)
            # The body's session_id (no header): created on that server, and only there.
            created = c.post("/v1/sessions", json={"session_id": sid})
            assert created.status_code == 201 and served_by(created) == home
            # The path's session id: the session is found, so this reached its server.
            got = c.get(f"/v1/sessions/{sid}")
            assert got.status_code == 200 and served_by(got) == home
            direct = next(s for s in cluster.servers if s.name != home)
            assert httpx.get(f"{direct.url}/v1/sessions/{sid}", headers=DEV_USER).status_code == 404
        # No session id at all: round-robin over both.
        assert {served_by(c.get("/healthz")) for _ in range(6)} == {"a", "b"}


def test_vllms_session_header_routes_like_dss_own(cluster: Cluster) -> None:
    """`X-Session-ID` (what vLLM and its clients send) keeps a session on its server, the one
    `X-DSS-Session` names it on: created there through the router, and found there only."""
    with httpx.Client(base_url=cluster.router_url, headers=DEV_USER, timeout=10) as c:
        homes = []
        for i in range(8):
            sid = f"vllm-{i}"
            created = c.post("/v1/sessions", json={}, headers={"X-Session-ID": sid})
            assert created.status_code == 201, created.text
            home = served_by(created)
            homes.append(home)
            for _ in range(3):
                got = c.get("/v1/sessions", headers={"X-Session-ID": sid})
                assert served_by(got) == home
            assert server_of(c, sid) == home
    assert set(homes) == {"a", "b"}, homes


def test_a_conversation_created_through_the_router_is_found_through_it(cluster: Cluster) -> None:
    """The id a server mints for a new conversation carries the route key the router chose for
    that request (`X-DSS-Route`): every later request naming the conversation, by its path or as
    a session, reaches the one server that holds it (each server has its own database here)."""
    with httpx.Client(base_url=cluster.router_url, headers=DEV_USER, timeout=10) as c:
        homes = []
        for _ in range(10):
            created = c.post("/v1/conversations", json={"metadata": {"topic": "routing"}})
            assert created.status_code == 200, created.text
            home, cid = served_by(created), created.json()["id"]
            homes.append(home)
            item = {"type": "message", "role": "user", "content": "Hello."}
            for r in (
                c.get(f"/v1/conversations/{cid}"),
                c.post(f"/v1/conversations/{cid}/items", json={"items": [item]}),
                c.get(f"/v1/conversations/{cid}/items"),
                c.get(f"/v1/sessions/{cid}/versions"),
                c.get("/v1/sessions", headers={"X-DSS-Session": cid}),
            ):
                assert r.status_code in (200, 201) and served_by(r) == home, r.text
            other = next(s for s in cluster.servers if s.name != home)
            assert httpx.get(f"{other.url}/v1/conversations/{cid}", headers=DEV_USER).status_code == 404
    assert set(homes) == {"a", "b"}, homes


def test_a_killed_servers_sessions_move_to_the_other_without_errors(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.router_url, headers=DEV_USER, timeout=10) as c:
        where = {f"fail-{i}": server_of(c, f"fail-{i}") for i in range(20)}
        victim_sid = next(sid for sid, s in where.items() if s == "a")
        log_before = cluster.log_path("haproxy").read_text()

        killed_at = time.monotonic()
        cluster.kill("a")  # kill -9 of the server's process group
        statuses, switched_s = [], None
        while time.monotonic() - killed_at < 10:
            r = c.get("/v1/sessions", headers={"X-DSS-Session": victim_sid})
            statuses.append(r.status_code)
            if switched_s is None and r.headers.get("X-DSS-Server") == "b":
                switched_s = time.monotonic() - killed_at
            if _marked_down(cluster, "a", log_before):
                break
            time.sleep(0.05)
        down_s = time.monotonic() - killed_at
        # The first request after the kill already went to b: the refused connection was retried
        # there (retry-on conn-failure + redispatch); the health check then took `a` out.
        assert switched_s is not None and switched_s < 1.0, statuses
        assert _marked_down(cluster, "a", log_before), cluster.log_tail("haproxy")
        assert down_s < 3 * CHECK_INTERVAL_MS / 1000 + 2, down_s
        after = [served_by(c.get("/v1/sessions", headers={"X-DSS-Session": sid})) for sid in where]
    assert all(s < 500 for s in statuses), statuses
    assert set(after) == {"b"}
    print(f"failover: first answer from b after {switched_s:.3f} s, a marked down after {down_s:.2f} s")


def _marked_down(cluster: Cluster, name: str, before: str) -> bool:
    log = cluster.log_path("haproxy").read_text()[len(before) :]
    return re.search(rf"Server dss_servers/{name} is DOWN", log) is not None


# ----------------------------------------------------------------------------------- streaming
class _SlowEvents(http.server.BaseHTTPRequestHandler):
    """An SSE stream of 3 events, 0.4 s apart (a backend the router cannot tell from DSS)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        if self.path == "/readyz":
            self._reply(b'{"status":"ready"}', "application/json")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(3):
            chunk = f"data: {i}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
            time.sleep(0.4)
        self.wfile.write(b"0\r\n\r\n")

    def _reply(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the health checks hang up right after their answer


def test_a_stream_passes_through_the_router_unbuffered(haproxy: str, tmp_path: Path) -> None:
    backend = _QuietServer(("127.0.0.1", 0), _SlowEvents)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    spec = ServerSpec("s", 1, backend.server_address[1], tmp_path / "s")
    router = Cluster(servers=[spec], work_dir=tmp_path, router_port=free_port(), haproxy=haproxy)
    try:
        router.start_router()  # deploy/haproxy.cfg, filled in and checked
        deadline = time.monotonic() + 10
        while True:
            try:
                httpx.get(router.router_url + "/readyz", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, router.log_tail("haproxy")
                time.sleep(0.05)
        arrivals = []
        start = time.monotonic()
        with httpx.stream("GET", router.router_url + "/v1/chat/completions", timeout=10) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic() - start)
        assert len(arrivals) == 3
        assert arrivals[0] < 0.3 and arrivals[2] - arrivals[0] > 0.6, arrivals  # each event when sent
    finally:
        router.stop()
        backend.shutdown()
