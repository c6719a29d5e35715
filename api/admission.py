"""A turn's generation slot, from the request's arrival to its last byte.

Admission happens first: the request takes its generation slot before any work and before its
response starts, streaming or not, so a burst beyond `max_inflight` gets its 503s at once. A
non-streaming request whose client goes away is stopped: its generation is aborted in the engine
and nothing is committed (a stream is stopped the same way by the streaming response itself).
Shared by `/v1/chat/completions`, the stateful `/v1/sessions/{sid}/messages` and `/v1/responses`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from api.chat_response import run_turn
from api.engine import ChatEngine, Slot
from api.errors import BadRequest, EngineOverloaded
from api.state import AppState
from api.turns import Turn

# Answers a built turn: a JSON response, or a streaming one (`api.chat_response.run_turn`).
Runner = Callable[[AppState, ChatEngine, Turn, Request], Coroutine[Any, Any, Any]]


async def serve_turn(
    state: AppState,
    engine: ChatEngine,
    request: Request,
    stream: bool,
    build: Callable[[], Awaitable[Turn]],
    run: Runner = run_turn,
) -> Any:
    """Admit the request, then build its turn (`build`: limits, where it attaches) and answer
    it with `run` (default: as a chat completion): JSON, stopped if the client leaves first; or
    a stream that holds the slot to its end."""
    slot = admit(state, engine)
    response: Response | None = None
    try:
        turn = await build()
        if not stream:
            return await stop_if_client_leaves(request, state, run(state, engine, turn, request))
        response = await run(state, engine, turn, request)
        return HoldingSlot(response, slot)
    finally:
        if response is None:
            slot.release()  # answered, or failed, without a stream (a stream gives it back itself)


def admit(state: AppState, engine: ChatEngine) -> Slot:
    try:
        return engine.admit()
    except EngineOverloaded:
        state.metrics.rejected.inc()
        raise


async def stop_if_client_leaves(request: Request, state: AppState, answer: Coroutine[Any, Any, Any]) -> Any:
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


class HoldingSlot(Response):
    """A streaming response that gives its request's slot back however it ends. The generation
    gives it back when it finishes, but a stream whose client left before its body started never
    runs its generator at all."""

    def __init__(self, inner: Response, slot: Slot) -> None:  # no super().__init__: nothing to render
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
