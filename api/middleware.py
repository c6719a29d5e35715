"""ASGI middleware: authentication before a body is read, the request body size limit, per-route
request metrics, development mode's Host-header allow-list, and the `X-DSS-Server` response
header."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.http_errors import ApiError, HostNotAllowed, PayloadTooLarge, response_for
from api.metrics import Metrics
from dss.errors import DSSError

access_log = logging.getLogger("dss.access")


class AuthBeforeBody:
    """A request that carries a body is authenticated from its headers (`authenticate`, which
    raises `Unauthorized`, `InvalidUserId` for a malformed `X-DSS-User`, or `ServerStarting`
    before the store is open) before any of the body
    is received; refused, it is answered at once and its body is never read. FastAPI receives
    and parses a body before it runs a route's dependencies (the key check among them), on the
    event loop: unauthenticated multi-megabyte posts slowed every other user's requests.
    Requests without a body are authenticated by the routes, as before."""

    def __init__(self, app: ASGIApp, authenticate: Callable[[Scope], Awaitable[None]]) -> None:
        self.app = app
        self.authenticate = authenticate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        try:
            await self.authenticate(scope)
        except (ApiError, DSSError) as exc:  # e.g. `Unauthorized`, or an `X-DSS-User` off the id rule
            refusal = response_for(exc)
            declared = _content_length(scope)
            if declared is None or declared > DRAIN_MAX_BYTES:
                # The server would still receive (and drop) the rest of the body to keep the
                # connection: closing it drops a big one unread.
                refusal.headers["Connection"] = "close"
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)


# A refused request's body up to this size is still received and dropped (by the HTTP server, not
# parsed), so that a client with a wrong key reads its 401 (most clients send the whole body before
# they read an answer) on a connection it may reuse; past it, or of unknown length, the connection
# is closed instead and the rest is never received (such a client may see the connection reset).
DRAIN_MAX_BYTES = 1 << 20


def _has_body(scope: Scope) -> bool:
    declared = _content_length(scope)
    if declared is not None:
        return declared > 0
    # No (valid) Content-Length: chunked, or a length that does not parse: assume a body.
    return any(name in (b"transfer-encoding", b"content-length") for name, _ in scope.get("headers", ()))


class BodyLimit:
    """413 for a declared Content-Length over the limit; a body that grows past it while being
    read fails the read with `PayloadTooLarge` (413 as well, through the error handlers)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            resp = response_for(self._too_large(declared))
            await resp(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large(seen)
            return msg

        await self.app(scope, limited, send)

    def _too_large(self, n: int) -> PayloadTooLarge:
        return PayloadTooLarge(
            f"the request body has {n} bytes, over the limit of {self.max_bytes}", code="body_too_large"
        )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class RequestMetrics:
    """Counts, times and logs every request by route template, never by concrete path, query
    string or user: paths carry user and session ids (`DELETE /v1/users/alice`), which an access
    log must not keep after an erasure. This is the server's access log (uvicorn's is off)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def sending(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            await send(msg)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = _route_of(scope)
            method = str(scope.get("method", ""))
            elapsed = time.perf_counter() - start
            self.metrics.http_requests.labels(route, method, str(status)).inc()
            self.metrics.request_seconds.labels(route).observe(elapsed)
            access_log.info("%s %s %d %.1fms", method, route, status, elapsed * 1e3)


def _route_of(scope: Scope) -> str:
    route: Any = scope.get("route")
    # `path_format`: the template without convertors (`/v1/users/{user_id}`, not `{user_id:path}`).
    path = getattr(route, "path_format", None) or getattr(route, "path", None)
    return str(path) if path else "unmatched"


SERVER_HEADER = "X-DSS-Server"


class ServerIdHeader:
    """Adds `X-DSS-Server: <server id>` to every response (errors and streams included), so a
    client or a test sees which server of a fleet behind a router answered. `server_id` is asked
    per response: the store that knows the id opens after the server listens; until an id is
    known (none configured, the store still opening), the header is left out."""

    def __init__(self, app: ASGIApp, server_id: Callable[[], str | None]) -> None:
        self.app = app
        self.server_id = server_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                sid = self.server_id()
                if sid:
                    headers = list(msg.get("headers", ()))
                    headers.append((SERVER_HEADER.lower().encode(), sid.encode("latin-1")))
                    msg = {**msg, "headers": headers}
            await send(msg)

        await self.app(scope, receive, sending)


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


class DevHostGuard:
    """Development mode only: refuse (421) a request whose Host is not a loopback name or one of
    `extra` (any port). Binding to loopback keeps other machines out, but not a web page the
    developer opens: its script can rebind its own DNS name to 127.0.0.1 and, being same-origin
    then, call an API where every caller is an admin. Such a request carries the attacker's name
    in its Host header, which is what this checks."""

    def __init__(self, app: ASGIApp, extra: list[str] | tuple[str, ...] = ()) -> None:
        self.app = app
        self.allowed = LOOPBACK_HOSTS | {h.strip().lower() for h in extra if h.strip()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = _host_header(scope)
        name = host_name(host) if host is not None else None
        if name is None or name not in self.allowed:
            shown = "no Host header" if host is None else f"the Host {host[:100]!r}"
            exc = HostNotAllowed(
                f"development mode answers only loopback hosts, not {shown}; add a name to "
                "DSS_AUTH__DEV_ALLOWED_HOSTS to allow it"
            )
            await response_for(exc)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _host_header(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"host":
            return bytes(value).decode("latin-1")
    return None


def host_name(host: str) -> str | None:
    """The name of a Host header without its port, lower case; `[::1]:8000` is `::1`. None for
    one that is not a plain host[:port]."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        if end < 0 or (host[end + 1 :] and not _is_port(host[end + 1 :])):
            return None
        return host[1:end]
    name, sep, port = host.rpartition(":")
    if not sep:
        return host or None
    if not _is_port(":" + port) or ":" in name:  # an unbracketed IPv6 address is not a Host
        return None
    return name or None


def _is_port(s: str) -> bool:
    return len(s) > 1 and s[0] == ":" and s[1:].isdigit()
