"""Serve a turn request over HTTP: admit it, resolve it, prepare it, and answer with its events
(`api.turn.pipeline.run_turn`) as a shape formats them (`Shape`, implemented in `api.shapes`): one
JSON body from the last event, or a stream of every event. The one call the turn routes make.

A non-streaming request whose client goes away is stopped (`stop_if_client_leaves`): its
generation is aborted in the engine and nothing is committed. A stream is stopped the same way
by its response (`HoldingSlot`), which also holds the request's generation slot to its last byte;
any other answer gives the slot back when it is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from api.http_errors import ApiError, BadRequest
from api.llm.chat_engine import ChatEngine
from api.llm.slots import Slot
from api.state import AppState
from api.turn.pipeline import Answered, Done, Failed, RecordResponse, TurnEvent, prepare, run_turn
from api.turn.request import Turn, TurnRequest, admit
from dss.errors import DSSError
from dss.types import FingerprintId

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Shape(Protocol):
    """How an API formats a turn's events (`api.shapes`): it formats, and runs nothing."""

    # What a request is told whose client left before its turn was committed.
    client_gone: str

    @property
    def record(self) -> RecordResponse | None:
        """A Responses turn's record maker (the turn stores the record with its version)."""
        ...

    def body(self, done: Done) -> Response:
        """The whole answer as one body, from the turn's last event."""
        ...

    def stream(self, events: AsyncIterator[TurnEvent]) -> AsyncGenerator[str, None]:
        """The stream's text, event by event (an error after the 200 comes as `Failed`)."""
        ...


async def serve_turn(
    state: AppState, engine: ChatEngine, request: Request, ask: TurnRequest, shape: Shape
) -> Response:
    """Admit the request, resolve its turn (which checks its limits), and answer it: JSON, stopped
    if the client leaves first; or a stream that holds the slot to its end."""
    slot, admitted = await admit(state, engine, ask.user)
    response: Response | None = None
    try:
        turn = await ask.resolve(state, admitted)
        prefetch_kv(state, turn)
        if not ask.stream:
            return await stop_if_client_leaves(request, state, _whole(state, engine, turn, request, shape))
        arrived = time.perf_counter()
        prep = await prepare(state, engine, turn)
        engine.slots.check_capacity()
        events = run_turn(state, engine, turn, prep, arrived, strict=False, record=shape.record)
        body = _streamed(shape, _reported(state, turn, events))
        response = HoldingSlot(
            StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS), slot
        )
        return response
    finally:
        if response is None:
            slot.release()  # answered, or failed, without a stream (a stream gives it back itself)


def prefetch_kv(state: AppState, turn: Turn) -> bool:
    """Start reading the KV of the version the turn extends from the shared tier into this
    server's host tier, now that its target is resolved, so that the engine's load finds it here
    (`KVLoads.prefetch`: never blocks, bounded). False when nothing was started."""
    base = turn.target.base if turn.target is not None else None
    store = state.store
    if base is None or not turn.persist or store.remote is None or not base.fingerprint or not base.n_tokens:
        return False
    return store.kv.loads.prefetch(FingerprintId(base.fingerprint), turn.admitted.tenant, base.tokens)


async def _whole(state: AppState, engine: ChatEngine, turn: Turn, request: Request, shape: Shape) -> Response:
    arrived = time.perf_counter()
    prep = await prepare(state, engine, turn)
    engine.slots.check_capacity()
    run = run_turn(state, engine, turn, prep, arrived, strict=True, record=shape.record)
    async with contextlib.aclosing(run) as events:
        async for ev in events:
            if isinstance(ev, Answered) and turn.target is not None and await request.is_disconnected():
                state.metrics.aborted.inc()
                raise BadRequest(shape.client_gone, code="client_disconnected")
            if isinstance(ev, Done):
                return shape.body(ev)
    raise ApiError("the turn ended without an answer")


async def _reported(
    state: AppState, turn: Turn, events: AsyncGenerator[TurnEvent, None]
) -> AsyncGenerator[TurnEvent, None]:
    """A stream's events: an error after its 200 becomes a `Failed` event; a stream cut before
    its turn was committed counts as aborted."""
    done = False
    try:
        async with contextlib.aclosing(events) as evs:
            async for ev in evs:
                done = isinstance(ev, Done)
                yield ev
    except (ApiError, DSSError) as exc:
        yield Failed(exc)
    except BaseException:
        if not done and turn.target is not None:
            state.metrics.aborted.inc()
        raise


async def _streamed(shape: Shape, events: AsyncGenerator[TurnEvent, None]) -> AsyncGenerator[str, None]:
    # Both closed as soon as this is (`HoldingSlot`): the events' generation is aborted at once.
    async with contextlib.aclosing(events) as evs, contextlib.aclosing(shape.stream(evs)) as out:
        async for text in out:
            yield text


class HoldingSlot(Response):
    """A streaming response that gives its request's slot back however it ends. The generation
    gives it back when it finishes, but a stream whose client left before its body started never
    runs its generator at all. A stream cut while it waited to send (its client left, or read
    nothing for `send_timeout_s`: `api.connections`) is closed here at once, which aborts its
    generation; Starlette leaves it to the garbage collector."""

    def __init__(
        self, inner: StreamingResponse, slot: Slot
    ) -> None:  # no super().__init__: nothing to render
        self.inner = inner
        self.slot = slot
        self.status_code = inner.status_code
        self.background = inner.background
        self.raw_headers = inner.raw_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.inner.background = self.background  # FastAPI may have set the route's background tasks
        try:
            await self.inner(scope, receive, send)
        finally:
            self.slot.release()
            body = self.inner.body_iterator
            if isinstance(body, AsyncGenerator):
                await body.aclose()


async def stop_if_client_leaves(
    request: Request, state: AppState, answer: Coroutine[Any, Any, Response]
) -> Response:
    """`answer`, unless the client disconnects first: then it is cancelled, which aborts its
    generation in the engine (vLLM aborts a request whose output stream is closed) before any
    version is committed. Without this a vanished client's answer ran to its last token."""
    work = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request itself is cancelled (the server stops): take both down
        work.cancel()
        gone.cancel()
        raise
    if work.done():
        gone.cancel()
        if gone.done() and not gone.cancelled():
            gone.exception()  # retrieved: a broken receive is no news once the answer is ready
        return work.result()
    if gone.exception() is not None:  # receive failed, no disconnect seen: just answer
        return await work
    work.cancel()
    await asyncio.wait((work,))  # let the generation unwind (abort, slot back) before answering
    if not work.cancelled():  # it finished just then: answer as usual (nobody reads it)
        return work.result()
    state.metrics.aborted.inc()
    raise BadRequest(
        "the client went away: its generation was stopped and nothing was committed",
        code="client_disconnected",
    )


async def _client_gone(request: Request) -> None:
    # The body is read: what the server receives from here on is the disconnect (or nothing).
    while (await request.receive())["type"] != "http.disconnect":
        pass
