"""Stub DSS backends behind the shipped router (deploy/haproxy.cfg through deploy/launcher.py's
`Cluster`, real HAProxy), for tests of where requests land: each stub names itself in
`X-DSS-Server` (as `dss serve` does), records what it saw, and mints response and conversation ids
the way `api.routes.responses` and `api.routes.conversations` do, with DSS's own functions
(`new_response_id`, `new_conversation_id`, `route_key_for`). Used by tests/deploy/test_route_forms.py
and by tests/api/test_open_webui.py (the real app's recorded requests through the router)."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from deploy.launcher import Cluster
from deploy.spec import ServerSpec
from dss.dialogue.conversations import new_conversation_id
from dss.dialogue.response_store import new_response_id
from dss.dialogue.route_keys import route_key_for
from tests.api_server import free_port

NAMES = "abc"


@dataclass
class Seen:
    """One request a stub answered."""

    server: str
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Stubs:
    """Stub backends by name; what each one saw."""

    servers: dict[str, http.server.ThreadingHTTPServer] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def specs(self, names: Sequence[str], work: Path) -> list[ServerSpec]:
        # The fixed ring ids of deploy/spec.py's server_specs: a=1, b=2, c=3, d=4.
        return [
            ServerSpec(n, ord(n) - ord("a") + 1, self.servers[n].server_address[1], work / n) for n in names
        ]


def _handler(name: str, stubs: Stubs) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            body = json.loads(raw) if raw else None
            path = self.path.split("?")[0]
            if path != "/readyz":
                with stubs.lock:
                    stubs.seen.append(Seen(name, self.command, path, dict(self.headers.items()), body))
            out: dict[str, Any] = {"server": name}
            route = self.headers.get("X-DSS-Route")
            if self.command == "POST" and path == "/v1/responses":
                conv = body.get("conversation")
                conv_id = conv.get("id") if isinstance(conv, dict) else conv
                out["id"] = new_response_id(route_key_for(body.get("previous_response_id"), conv_id, route))
            elif self.command == "POST" and path == "/v1/conversations":
                out["id"] = new_conversation_id(route)
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("X-DSS-Server", name)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = _answer

        def log_message(self, *args: object) -> None:
            pass

    return Handler


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the health checks hang up right after their answer


def start_router(
    haproxy: str, stubs: Stubs, work: Path, names: Sequence[str] = NAMES, session_headers: Sequence[str] = ()
) -> Cluster:
    """deploy/haproxy.cfg filled in for the stubs `names` (as `Cluster.start` does), answering."""
    work.mkdir(parents=True, exist_ok=True)
    router = Cluster(
        servers=stubs.specs(names, work),
        work_dir=work,
        router_port=free_port(),
        haproxy=haproxy,
        check_interval_ms=200,
        session_headers=session_headers,
    )
    router.start_router()
    deadline = time.monotonic() + 10
    up: set[str] = set()
    while up != set(names):  # every stub passed its health check: in the pool
        with contextlib.suppress(httpx.HTTPError):
            up.add(httpx.get(router.router_url + "/healthz", timeout=1).headers["X-DSS-Server"])
        assert time.monotonic() < deadline, router.log_tail("haproxy")
        time.sleep(0.02)
    return router


def served_by(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.headers["X-DSS-Server"]


@contextlib.contextmanager
def running_stubs(names: str = "abcd") -> Iterator[Stubs]:
    """Stub backends `names`, each on its own loopback port, stopped on the way out."""
    s = Stubs()
    for name in names:
        server = _QuietServer(("127.0.0.1", 0), _handler(name, s))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        s.servers[name] = server
    try:
        yield s
    finally:
        for server in s.servers.values():
            server.shutdown()
