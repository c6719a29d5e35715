"""Public prefixes (admin): shared, pre-warmed prompt beginnings such as a common system prompt."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request, status

from api.deps import AdminDep, CallerDep, EngineDep, StateDep
from api.http_errors import EngineUnavailable, error_responses
from api.llm.chat_engine import ChatEngine
from api.llm.generation import Finished, generate
from api.shapes.resources import PrefixCreate, PrefixOut
from api.shapes.schemas import Deleted, ListResponse
from api.state import AppState
from dss.ops.kv.public_prefixes import PrefixInfo
from dss.types import PUBLIC_TENANT, SessionId

router = APIRouter(tags=["prefixes"])

_WARM_WAIT_S = 10.0


def _out(p: PrefixInfo) -> PrefixOut:
    return PrefixOut(
        id=p.id,
        n_tokens=p.n_tokens,
        pinned=p.pinned,
        text=p.text,
        cached_tokens=p.cached_tokens,
        created_at=p.created_at,
    )


async def _warm(state: AppState, engine: ChatEngine, tokens: list[int], prefix_id: str) -> None:
    """One generation of a single token under the public tenant: the connector saves its pages."""
    one_token = engine.sampling([], {"temperature": 0.0}, max_tokens=1)
    async with engine.slots.admitted():
        async for ev in generate(
            engine,
            tokens,
            one_token,
            tenant=PUBLIC_TENANT,
            cache_salt=PUBLIC_TENANT,
            session_id=SessionId(prefix_id),
            arrived=time.perf_counter(),
        ):
            if isinstance(ev, Finished):
                break
    # The connector saves the pages once the request is done; wait for them (bounded).
    assert engine.fingerprint is not None
    deadline = time.monotonic() + _WARM_WAIT_S
    while time.monotonic() < deadline:
        if await asyncio.to_thread(state.store.prefixes.warmed, engine.fingerprint, tokens):
            return
        await asyncio.sleep(0.05)


@router.post(
    "/v1/prefixes",
    status_code=status.HTTP_201_CREATED,
    response_model=PrefixOut,
    responses=error_responses(400, 401, 403, 503),
)
async def create_prefix(
    body: PrefixCreate, request: Request, state: StateDep, _admin: AdminDep, engine: EngineDep
) -> PrefixOut:
    """Register a public prefix (`messages` through the chat template, or raw `text`), warm it,
    and optionally pin its pages so eviction never takes them."""
    if engine.fingerprint is None:
        raise EngineUnavailable("the engine's model fingerprint is unknown; public prefixes are unavailable")
    messages: list[dict[str, Any]] | None = None
    if body.messages is not None:
        messages = [m.plain() for m in body.messages]
        tokens = await asyncio.to_thread(engine.render, messages, False)
    else:
        assert body.text is not None
        tokens = await asyncio.to_thread(engine.encode, body.text)
    engine.check_length(len(tokens), 1, 1)
    info = await asyncio.to_thread(
        state.store.prefixes.register,
        engine.fingerprint,
        tokens,
        text=body.text,
        messages=messages,
        pin=body.pin,
    )
    await _warm(state, engine, tokens, info.id)
    return _out(await asyncio.to_thread(state.store.prefixes.get, info.id))


@router.get("/v1/prefixes", response_model=ListResponse[PrefixOut], responses=error_responses(401))
def list_prefixes(state: StateDep, _caller: CallerDep) -> ListResponse[PrefixOut]:
    data = [_out(p) for p in state.store.prefixes.list()]
    return ListResponse[PrefixOut](
        data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None
    )


@router.delete("/v1/prefixes/{prefix_id}", response_model=Deleted, responses=error_responses(401, 403, 404))
def delete_prefix(prefix_id: str, state: StateDep, _admin: AdminDep) -> Deleted:
    state.store.prefixes.delete(prefix_id)
    return Deleted(id=prefix_id, object="prefix.deleted")
