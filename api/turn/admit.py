"""Admit a turn: its generation slot on arrival, and the user's erasure epoch.

The request takes its generation slot before any work and before its response starts, streaming
or not, so a burst beyond `max_inflight` gets its 503s at once. A stream holds the slot to its
last byte (`HoldingSlot`); any other answer gives it back when it is answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from api.errors import EngineOverloaded, UserSlotsExhausted
from api.llm.chat_engine import ChatEngine
from api.llm.slots import Slot
from api.state import AppState
from dss.types import UserId


def take_slot(state: AppState, engine: ChatEngine, user: UserId) -> Slot:
    """The request's generation slot, counted in `user`'s share (an end user of a frontend key:
    their own share, not the frontend's)."""
    try:
        return engine.slots.admit(user)
    except UserSlotsExhausted:
        state.metrics.rejected_user_share.inc()
        raise
    except EngineOverloaded:
        state.metrics.rejected.inc()
        raise


async def admitted_epoch(state: AppState, user: UserId) -> int:
    """The user's erasure epoch as a turn is admitted, before it reads or writes anything."""
    return await asyncio.to_thread(state.store.identity.epoch_of, user)


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
