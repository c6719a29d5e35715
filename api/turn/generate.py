"""Generate a turn: the engine's stream of `Delta`s and `Finished`s, every choice, and each
choice's answer as the client sees it (tool calls split off by the configured parser)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

from api.llm.chat_engine import ChatEngine
from api.llm.generation import Delta, Finished, generate
from api.turn.types import Answer, Prepared, Turn


def events(
    engine: ChatEngine, turn: Turn, prep: Prepared, arrived: float
) -> AsyncGenerator[Delta | Finished, None]:
    target = turn.target
    return generate(
        engine,
        prep.prompt_ids,
        prep.sampling,
        tenant=prep.tenant,
        cache_salt=prep.salt,
        session_id=target.session_id if target is not None else None,
        arrived=arrived,
        persist=turn.persist,
    )


async def generate_all(engine: ChatEngine, turn: Turn, prep: Prepared, arrived: float) -> list[Finished]:
    """Every choice of the turn, finished, in index order."""
    fins: list[Finished] = []
    async with engine.slots.admitted(), contextlib.aclosing(events(engine, turn, prep, arrived)) as evs:
        async for ev in evs:
            if isinstance(ev, Finished):
                fins.append(ev)
    return sorted(fins, key=lambda f: f.index)


@contextlib.asynccontextmanager
async def streamed(
    engine: ChatEngine, turn: Turn, prep: Prepared, arrived: float
) -> AsyncIterator[AsyncGenerator[Delta | Finished, None]]:
    """The turn's events for a stream: in the request's slot, taken even when none is free (the
    stream's capacity was checked before its 200 went out); leaving early aborts the generation."""
    async with (
        engine.slots.admitted(strict=False),
        contextlib.aclosing(events(engine, turn, prep, arrived)) as evs,
    ):
        yield evs


def answer(engine: ChatEngine, prep: Prepared, fin: Finished) -> Answer:
    if not prep.sampling.parse_tools:
        return Answer(fin, fin.text, [], fin.finish_reason)
    content, calls = engine.tool_calls(prep.sampling, fin.text)
    return Answer(fin, content, calls, "tool_calls" if calls else fin.finish_reason)
