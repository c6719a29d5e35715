"""A request's body is read only once its headers authenticate it (issue 19, item 12), and a body
over the size limit stops being read: checked over real HTTP against `dss serve --no-engine`,
with clients that send headers and then withhold the body. The server used to receive and parse
every body (on its event loop) before it looked at the key, so those clients waited forever.
`bench/auth_flood.py` measures what that did to another user's latency."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.api_server import ApiServer

LIMIT = 2 << 20  # the server's max_body_bytes here
BIG = 1_500_000  # within the limit, over what a refused request's connection still receives
ANSWER_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    srv = ApiServer(
        None, tmp_path_factory.mktemp("auth-body"), env={"DSS_SERVER__MAX_BODY_BYTES": str(LIMIT)}
    )
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def send_head(srv: ApiServer, headers: dict[str, str], path: str = "/v1/sessions") -> socket.socket:
    """A connection that has sent a POST's request line and headers, and nothing of its body."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=ANSWER_TIMEOUT_S)
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{srv.port}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], dict[str, object]]:
    """Status, headers (lower-case names) and JSON body of one response (Content-Length framed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)  # a timeout here: the server is still waiting for the body
        assert chunk, f"connection closed before an answer: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk
        rest += chunk
    return int(status_line.split()[1]), headers, json.loads(rest[:length] or b"{}")


@pytest.mark.parametrize(
    "auth",
    [{}, {"Authorization": "Bearer dss-not-a-key"}, {"Authorization": "Bearer sk-openai"}],
    ids=["no-key", "wrong-key", "foreign-key"],
)
@pytest.mark.parametrize("framing", ["declared", "chunked"])
def test_unauthenticated_body_is_refused_before_it_is_sent(
    server: ApiServer, auth: dict[str, str], framing: str
) -> None:
    size = {"Content-Length": str(BIG)} if framing == "declared" else {"Transfer-Encoding": "chunked"}
    with send_head(server, {**auth, **size}) as sock:
        status, headers, body = read_answer(sock)
    assert status == 401, body
    assert body["error"]["code"] == "invalid_api_key"  # type: ignore[index]
    assert headers.get("connection") == "close"  # a big (or unknown) body is not received at all


def test_small_refused_body_is_answered_on_a_connection_that_stays_usable(server: ApiServer) -> None:
    """A client with a wrong key sends its (small) body before it reads: it gets its 401, and the
    connection serves the next request."""
    body = b'{"session_id": "small"}'
    with send_head(server, {"Content-Length": str(len(body))}) as sock:
        status, headers, _ = read_answer(sock)
        assert status == 401 and headers.get("connection") != "close"
        sock.sendall(body)  # sent after the answer: dropped by the server, not taken for a request
        sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n\r\n".encode())
        status, _, health = read_answer(sock)
        assert status == 200 and health["status"] == "ok"


def test_authenticated_bodies_are_bounded_before_they_are_read(server: ApiServer) -> None:
    key = {"Authorization": f"Bearer {server.key('alice')}"}
    with send_head(server, {**key, "Content-Length": str(LIMIT + 1)}) as sock:
        status, _, body = read_answer(sock)  # declared too large: answered without the body
    assert status == 413 and body["error"]["code"] == "body_too_large"  # type: ignore[index]
    with send_head(server, {**key, "Transfer-Encoding": "chunked"}) as sock:
        chunk = b"x" * 8192
        for _ in range(LIMIT // len(chunk) + 2):  # past the limit, and never the final chunk
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        status, _, body = read_answer(sock)
    assert status == 413 and body["error"]["code"] == "body_too_large"  # type: ignore[index]
    # And an authenticated body within the limit is read as ever.
    payload = json.dumps({"session_id": "ok"}).encode()
    with send_head(server, {**key, "Content-Length": str(len(payload))}) as sock:
        sock.sendall(payload)
        status, _, body = read_answer(sock)
    assert status == 201 and body["id"] == "ok"


def test_dev_mode_still_reads_keyless_bodies_and_checks_dss_tokens_first(tmp_path: Path) -> None:
    """Development mode authenticates without a key: a body without one is read as before."""
    srv = ApiServer(None, tmp_path, dev=True)
    srv.start()
    try:
        payload = json.dumps({"session_id": "dev"}).encode()
        with send_head(srv, {"Content-Length": str(len(payload)), "X-DSS-User": "bob"}) as sock:
            sock.sendall(payload)
            status, _, body = read_answer(sock)
        assert status == 201 and body["id"] == "dev"
        with send_head(srv, {"Content-Length": str(BIG), "Authorization": "Bearer dss-typo"}) as sock:
            status, _, _ = read_answer(sock)  # a dss- token is still checked, before the body
        assert status == 401
    finally:
        srv.stop()
