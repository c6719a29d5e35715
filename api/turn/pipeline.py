"""A turn, from the request's arrival to its last byte: admit → resolve the target → check the
limits → build the prompt → generate → commit, and a reply (`Reply`, in `api.shapes`) shapes
the answer. The one call the turn routes make (`serve_turn`).

A non-streaming request whose client goes away is stopped: its generation is aborted in the
engine and nothing is committed (a stream is stopped the same way by the streaming response
itself). Shared by `/v1/chat/completions`, `/v1/sessions/{sid}/messages` and `/v1/responses`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from api.errors import BadRequest
from api.llm.chat_engine import ChatEngine
from api.llm.generation import Delta, Finished
from api.state import AppState
from api.turn.admit import HoldingSlot, admitted_epoch, take_slot
from api.turn.commit import commit
from api.turn.generate import answer, generate_all, streamed
from api.turn.prompt import prepare
from api.turn.types import Answer, Prepared, Turn
from dss.dialogue.turn_commits import Committed
from dss.types import UserId

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# Resolves the turn's target under the epoch it was admitted with (`api.turn.target`).
Resolve = Callable[[int], Awaitable[Turn]]
# Runs in the commit's worker thread right after the commit (a Responses record, say).
AfterCommit = Callable[[list[Committed]], None]


@dataclass(frozen=True, slots=True)
class TurnRun:
    """One admitted, resolved, prepared turn, as its reply drives its generation and commit."""

    state: AppState
    engine: ChatEngine
    turn: Turn
    prep: Prepared
    arrived: float

    def events(self) -> AbstractAsyncContextManager[AsyncGenerator[Delta | Finished, None]]:
        """The generation's events, for a stream (`api.turn.generate.streamed`)."""
        return streamed(self.engine, self.turn, self.prep, self.arrived)

    def answer(self, fin: Finished) -> Answer:
        return answer(self.engine, self.prep, fin)

    async def commit(
        self, answers: Sequence[Answer], then: AfterCommit | None = None
    ) -> list[Committed | None]:
        return await commit(self.state, self.engine, self.turn, self.prep, answers, then)


class Reply(Protocol):
    """How an API shapes a turn's answer (`api.shapes`): one JSON body, or a stream."""

    # What a request is told whose client left before its turn was committed.
    client_gone: str

    def after_commit(self, run: TurnRun, answers: Sequence[Answer]) -> AfterCommit | None: ...

    def body(
        self, run: TurnRun, answers: Sequence[Answer], committed: Sequence[Committed | None]
    ) -> Response: ...

    def stream(self, run: TurnRun) -> AsyncIterator[str]:
        """The stream's events: it generates (`run.events`), commits after the last token
        (`run.commit`), and reports an error as an event."""
        ...


async def serve_turn(
    state: AppState,
    engine: ChatEngine,
    request: Request,
    user: UserId,
    stream: bool,
    resolve: Resolve,
    reply: Reply,
) -> Any:
    """Admit the request, resolve its turn (which checks its limits), and answer it: JSON, stopped if
    the client leaves first; or a stream that holds the slot to its end."""
    slot = take_slot(state, engine, user)
    response: Response | None = None
    try:
        epoch = await admitted_epoch(state, user)
        turn = await resolve(epoch)
        if not stream:
            return await stop_if_client_leaves(
                request, state, _answer_whole(state, engine, turn, request, reply)
            )
        arrived = time.perf_counter()
        prep = await prepare(state, engine, turn)
        engine.slots.check_capacity()
        run = TurnRun(state, engine, turn, prep, arrived)
        response = StreamingResponse(reply.stream(run), media_type="text/event-stream", headers=SSE_HEADERS)
        return HoldingSlot(response, slot)
    finally:
        if response is None:
            slot.release()  # answered, or failed, without a stream (a stream gives it back itself)


async def _answer_whole(
    state: AppState, engine: ChatEngine, turn: Turn, request: Request, reply: Reply
) -> Any:
    arrived = time.perf_counter()
    prep = await prepare(state, engine, turn)
    engine.slots.check_capacity()
    fins = await generate_all(engine, turn, prep, arrived)
    if turn.target is not None and await request.is_disconnected():
        state.metrics.aborted.inc()
        raise BadRequest(reply.client_gone, code="client_disconnected")
    run = TurnRun(state, engine, turn, prep, arrived)
    answers = [run.answer(f) for f in fins]
    committed = await run.commit(answers, then=reply.after_commit(run, answers))
    return reply.body(run, answers, committed)


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
