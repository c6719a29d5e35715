"""Bounds on slow clients, kept by the HTTP protocol that uvicorn runs for each connection.

uvicorn bounds the idle time between two requests of a connection (`timeout_keep_alive`) but
neither of these, which this protocol adds (`guarded_protocol`, passed to `uvicorn.Config`):

- The request head. A connection that sent half a request line, or nothing at all, was held for
  as long as its client kept it open. Here it has `header_timeout_s` from its start (or, on a
  kept-alive connection, from the next request's first byte) to complete its request line and
  headers; then it gets a 408 and is closed (closed without a word if it sent nothing).
- A response its client does not read. Once the socket's buffers are full uvicorn pauses the
  response's writes (`FlowControl.drain`) for as long as the client stays connected, and a stream
  held its generation slot all that time. Here writes may stay paused for `send_timeout_s`; then
  the connection is aborted (a close would wait for the buffer to drain, which is what never
  happens). The app then receives `http.disconnect` and the stream stops as it does when its
  client leaves (`api.turn.pipeline`): the generation is aborted, its slot comes back, and
  nothing is committed unless the commit had begun.

Each cut is counted (`dss_connections_cut_total{reason}`) and logged. Both timers are loop
timers of the connection, armed and disarmed by the protocol's own callbacks: no task, no lock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Literal

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("dss.api.connections")

CutReason = Literal["header_timeout", "send_timeout"]

_TIMEOUT_TEXT = b"the request head was not sent in time"
_REQUEST_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_TIMEOUT_TEXT), _TIMEOUT_TEXT)
)


def guarded_protocol(
    header_timeout_s: float, send_timeout_s: float, on_cut: Callable[[CutReason], object]
) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with both bounds; `on_cut` hears of every connection cut."""

    return type(
        "GuardedHttpProtocol",
        (_Guarded,),
        {"header_timeout_s": header_timeout_s, "send_timeout_s": send_timeout_s, "on_cut": on_cut},
    )


class _Guarded(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    send_timeout_s: float = 30.0
    on_cut: Callable[[CutReason], object]  # read through the class: a plain function, not a method

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._conn: asyncio.Transport | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._head_started = False  # a byte of the current request head has arrived

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._conn = transport  # type: ignore[assignment]
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._disarm_stall_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.send_timeout_s, self._on_stalled)

    def resume_writing(self) -> None:
        self._disarm_stall_timer()
        super().resume_writing()

    # httptools parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_started = True
        self._arm_head_timer()  # a kept-alive connection's next request: its first byte

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        self._head_started = False
        super().on_headers_complete()

    # the bounds
    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._on_head_timeout)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _disarm_stall_timer(self) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        conn = self._conn
        if conn is None or conn.is_closing():
            return
        # No peer address: log lines name no client (docs/privacy.md, "Logs").
        log.info(
            "closed a connection: no complete request head within %.1f s (header_timeout_s)",
            self.header_timeout_s,
        )
        type(self).on_cut("header_timeout")
        if self._head_started:
            conn.write(_REQUEST_TIMEOUT)
        conn.close()

    def _on_stalled(self) -> None:
        self._stall_timer = None
        conn = self._conn
        if conn is None:
            return
        log.warning(
            "aborted a connection: its client read nothing of the response for %.1f s "
            "(send_timeout_s); a stream on it stops as if its client had left",
            self.send_timeout_s,
        )
        type(self).on_cut("send_timeout")
        conn.abort()
