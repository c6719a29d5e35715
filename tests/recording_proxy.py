"""A recording reverse proxy for frontend tests: it stands between a real frontend (Open WebUI)
and `dss serve`, forwards every request unchanged (streamed answers stay streamed) and keeps
what went each way, so a test can assert on the requests the frontend really sends (which
headers, the whole history or not, what "regenerate" and "edit" look like) and on the answers
DSS gave (`usage.prompt_tokens_details.cached_tokens`, `session_id`, `state_version`).

Invariant: the proxy changes nothing but the `Host` header (and drops hop-by-hop headers);
`Exchange.response_body` is the answer's bytes as DSS sent them, SSE included.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tests.api_server import free_port

__all__ = ["Exchange", "RecordingProxy"]

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-length",
}


@dataclass
class Exchange:
    """One request through the proxy and DSS's answer."""

    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    status: int = 0
    response_body: bytes = b""
    done: bool = False

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def answer(self) -> dict[str, Any]:
        """The answer as one JSON object: a plain response's body, or a stream's chunks folded
        (the last chunk's `usage`, DSS's session fields, the text joined)."""
        text = self.response_body.decode("utf-8", "replace")
        if not text.lstrip().startswith("data:") and "\ndata:" not in text:
            parsed: dict[str, Any] = json.loads(text)
            return parsed
        folded: dict[str, Any] = {"content": ""}
        for line in text.splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for key in ("session_id", "state_version", "parent_version", "branch", "id"):
                if key in chunk:
                    folded[key] = chunk[key]
            if chunk.get("usage"):
                folded["usage"] = chunk["usage"]
            for choice in chunk.get("choices") or []:
                folded["content"] += (choice.get("delta") or {}).get("content") or ""
        return folded


class RecordingProxy:
    """`http://127.0.0.1:{port}` forwards to `upstream`; `exchanges` in arrival order."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._server = uvicorn.Server(
            uvicorn.Config(
                self._app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                lifespan="off",
                interface="asgi3",
            )
        )
        self._thread = threading.Thread(target=self._server.run, name="recording-proxy", daemon=True)

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the recording proxy did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def chat_requests(self) -> list[Exchange]:
        """The finished chat completions, in order."""
        with self._lock:
            return [e for e in self.exchanges if e.path.endswith("/chat/completions") and e.done]

    def __iter__(self) -> Iterator[Exchange]:
        with self._lock:
            return iter(list(self.exchanges))

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        body = await request.body()
        headers = {k.lower(): v for k, v in request.headers.items()}
        exchange = Exchange(request.method, request.url.path, headers, body)
        with self._lock:
            self.exchanges.append(exchange)
        client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0))
        url = self.upstream + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        forwarded = {k: v for k, v in headers.items() if k not in _HOP_BY_HOP}
        upstream = await client.send(
            client.build_request(request.method, url, headers=forwarded, content=body), stream=True
        )
        exchange.status = upstream.status_code

        async def relay() -> AsyncIterator[bytes]:
            async for piece in upstream.aiter_raw():
                exchange.response_body += piece
                yield piece
            exchange.done = True

        async def close() -> None:
            await upstream.aclose()
            await client.aclose()

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
        response: Response = StreamingResponse(
            relay(), status_code=upstream.status_code, headers=out_headers, background=BackgroundTask(close)
        )
        await response(scope, receive, send)
