"""Real client libraries, unmodified and configured as their own docs say for an OpenAI-compatible
server, against the real `dss serve` (the shared `api_server`, one engine): LangChain's
`ChatOpenAI`, instructor, pydantic-ai and openai-agents (docs/frontends.md shows each setup).

Each library gets only a base URL, a DSS key and, where it takes them, extra headers or body fields:
nothing here reaches past a library's public configuration. The model is tiny, so prompts are
trivial and the assertions are about structure (a valid pydantic object, a chain of response ids,
a session's versions, `cached_tokens`), never about what the model says; structured answers go
through the server's structured outputs (`response_format: json_schema`), which make the tiny
model's JSON valid. The versions are pinned in pyproject.toml's dev extra.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from datetime import datetime, timedelta
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field

from tests.api_server import ApiServer, api_server

pytestmark = [pytest.mark.engine]
__all__ = ["api_server"]

TIMEOUT_S = 180.0


class City(BaseModel):
    """The structured answer instructor and pydantic-ai ask for (a bounded name keeps the tiny
    model's JSON short enough to close within max_tokens)."""

    name: str = Field(max_length=16)
    population: int


def session_versions(server: ApiServer, user: str, session_id: str) -> list[int]:
    with server.client(user) as c:
        r = c.get(f"/v1/sessions/{session_id}/versions")
    assert r.status_code == 200, r.text
    return [v["number"] for v in r.json()["data"]]


def test_langchain_chat_openai_turns_land_in_a_session_and_report_cached_tokens(
    api_server: ApiServer,
) -> None:
    from langchain_core.messages import AIMessage
    from langchain_openai import ChatOpenAI

    session_id = f"lc-{uuid.uuid4().hex[:8]}"
    llm = ChatOpenAI(
        base_url=api_server.base_url + "/v1",
        api_key=api_server.key("cl-lang"),
        model="default",
        max_tokens=8,
        temperature=0,
        max_retries=0,
        timeout=TIMEOUT_S,
        default_headers={"X-DSS-Session": session_id},
    )
    first = llm.invoke("Say hi.")
    assert isinstance(first, AIMessage) and isinstance(first.content, str)
    assert first.usage_metadata is not None
    second = llm.invoke([("user", "Say hi."), ("assistant", first.content), ("user", "Again.")])
    assert second.usage_metadata is not None
    # The second turn's prompt continues the first turn's stored KV: all of it but the last
    # sampled token, whose KV the first turn never computed.
    cached = second.usage_metadata.get("input_token_details", {}).get("cache_read")
    assert cached == first.usage_metadata["total_tokens"] - 1
    assert session_versions(api_server, "cl-lang", session_id) == [1, 2]


def test_instructor_returns_a_pydantic_model_through_structured_outputs(api_server: ApiServer) -> None:
    import instructor

    # JSON_SCHEMA mode sends `response_format: json_schema`, which the server hands to vLLM's
    # structured outputs. (TOOLS mode names the tool in `tool_choice`, which DSS refuses.)
    client = instructor.from_openai(api_server.openai("cl-instr"), mode=instructor.Mode.JSON_SCHEMA)
    city, completion = client.chat.completions.create_with_completion(
        model="default",
        response_model=City,
        messages=[{"role": "user", "content": "Name a city and its population."}],
        max_tokens=64,
        temperature=0,
        max_retries=0,
        extra_body={"session_id": f"in-{uuid.uuid4().hex[:8]}"},
    )
    assert isinstance(city, City)
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None and completion.usage.prompt_tokens > 0
    assert completion.model_extra is not None and completion.model_extra["state_version"] == 1


def test_pydantic_ai_agent_returns_structured_output_and_continues_its_session(
    api_server: ApiServer,
) -> None:
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    session_id = f"pa-{uuid.uuid4().hex[:8]}"
    provider = OpenAIProvider(base_url=api_server.base_url + "/v1", api_key=api_server.key("cl-pyai"))
    agent = Agent(
        OpenAIChatModel("default", provider=provider),
        output_type=NativeOutput(City),
        model_settings={
            "max_tokens": 64,
            "temperature": 0,
            "timeout": TIMEOUT_S,
            "extra_headers": {"X-DSS-Session": session_id},
        },
    )
    first = agent.run_sync("Name a city and its population.")
    assert isinstance(first.output, City) and first.usage.requests == 1
    second = agent.run_sync("Name another.", message_history=first.all_messages())
    assert isinstance(second.output, City)
    assert second.usage.cache_read_tokens == first.usage.input_tokens + first.usage.output_tokens - 1
    assert session_versions(api_server, "cl-pyai", session_id) == [1, 2]


def agents_model(server: ApiServer, user: str) -> tuple[Any, Any]:
    """An openai-agents `Agent` on DSS's Responses API, and its client. Tracing is off: it would
    upload each run's trace to OpenAI."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key=server.key(user), timeout=TIMEOUT_S, max_retries=0
    )
    agent = Agent(
        name="terse",
        instructions="You answer in a few words.",
        model=OpenAIResponsesModel("default", client),
        model_settings=ModelSettings(max_tokens=8, temperature=0),
    )
    return agent, client


def test_openai_agents_chain_runs_with_previous_response_id(api_server: ApiServer) -> None:
    from agents import Runner

    async def run() -> None:
        agent, client = agents_model(api_server, "cl-agents")
        first = await Runner.run(agent, "Say hi.")
        second = await Runner.run(agent, "Again.", previous_response_id=first.last_response_id)
        assert first.last_response_id and second.last_response_id != first.last_response_id
        stored = await client.responses.retrieve(second.last_response_id)
        assert stored.previous_response_id == first.last_response_id
        assert stored.output_text == second.final_output
        # The chained turn continues the first one's stored KV (all but its last sampled token).
        usage = second.context_wrapper.usage
        assert usage.input_tokens_details.cached_tokens == first.context_wrapper.usage.total_tokens - 1

    asyncio.run(run())


def test_openai_agents_runs_keep_their_history_in_an_openai_conversations_session(
    api_server: ApiServer,
) -> None:
    from agents import OpenAIConversationsSession, Runner

    async def run() -> None:
        agent, client = agents_model(api_server, "cl-conv")
        session = OpenAIConversationsSession(openai_client=client)
        first = await Runner.run(agent, "Say hi.", session=session)
        second = await Runner.run(agent, "Again.", session=session)
        # The session made a conversation on the server and keeps each run's input and output in it.
        conversation = await client.conversations.retrieve(session.session_id)
        items = [i async for i in client.conversations.items.list(conversation.id, order="asc")]
        assert [(i.type, getattr(i, "role", None)) for i in items] == [
            ("message", "user"),
            ("message", "assistant"),
        ] * 2
        assert second.final_output == items[-1].content[0].text
        # The second run sent the whole history: its prefix, the first run, was served from cache.
        assert second.context_wrapper.usage.input_tokens_details.cached_tokens > 0
        assert first.context_wrapper.usage.input_tokens < second.context_wrapper.usage.input_tokens
        await session.clear_session()
        with pytest.raises(openai.NotFoundError):
            await client.conversations.retrieve(conversation.id)

    asyncio.run(run())


# A system prompt's usual bulk after the time: the history computed under it is what a lead
# update keeps, and what a turn without one recomputes from the time on (only the tokens before
# the first changed digit are shared: a long prompt keeps them a small share).
CLOCK_PERSONA = (
    "You are the assistant of a small family bakery on the corner of Mill Street. You answer "
    "questions about bread, pastries, cakes, opening hours, allergens and orders in a few friendly "
    "words. The bakery opens at seven in the morning on weekdays and at eight on Saturdays; it is "
    "closed on Sundays and on public holidays. Rye, spelt and white sourdough loaves are baked "
    "every morning; croissants and cinnamon buns sell out by ten. Celebration cakes need two "
    "days' notice and a deposit, paid in the shop. Never invent prices, never promise a delivery "
    "time, and never give medical advice about allergies: point to the allergen sheet at the "
    "counter instead. When you do not know something, say so plainly and suggest calling the shop "
    "during opening hours. If someone asks about gluten-free bread, say that the bakery bakes "
    "it on Thursdays only, in a separate oven, and that it should be ordered the day before. If "
    "someone asks for a job, point them to the notice by the door. If someone complains, thank "
    "them, apologise once, and ask them to speak to the owner in the shop. Keep every answer "
    "short, polite and in plain language, and do not use "
    "lists or headings."
)
CLOCK_QUESTIONS = ["Do you bake rye bread?", "And on Sundays?", "Can I order a cake for Friday?", "Thanks!"]


def clock_agent_turns(server: ApiServer, user: str, mode: str) -> list[dict[str, Any]]:
    """Four chained openai-agents runs (`previous_response_id`) of an Agent whose instructions
    carry the time, 47 s later on every call, as a frontend's templated system prompt does; lead
    updates `mode` asked for as openai-agents lets one: `volatile` in the model settings' extra
    body, `off` in the client's default headers. Per run: what it used and what DSS stored."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    start, calls = datetime(2026, 12, 5, 9, 14, 2), itertools.count()

    def instructions(_ctx: Any, _agent: Any) -> str:
        now = start + timedelta(seconds=47 * next(calls))
        return f"{now:%Y-%m-%d %H:%M:%S} is the time now. {CLOCK_PERSONA}"

    on = mode != "off"
    client = AsyncOpenAI(
        base_url=server.base_url + "/v1",
        api_key=server.key(user),
        timeout=TIMEOUT_S,
        max_retries=0,
        default_headers={} if on else {"X-DSS-Lead-Updates": mode},
    )
    agent = Agent(
        name="clock",
        instructions=instructions,
        model=OpenAIResponsesModel("default", client),
        model_settings=ModelSettings(
            max_tokens=24, temperature=0, extra_body={"lead_updates": mode} if on else None
        ),
    )

    async def run() -> list[dict[str, Any]]:
        turns: list[dict[str, Any]] = []
        previous = None
        for question in CLOCK_QUESTIONS:
            result = await Runner.run(agent, question, previous_response_id=previous)
            previous = result.last_response_id
            assert previous
            stored = await client.responses.retrieve(previous)
            usage = result.context_wrapper.usage
            turns.append(
                {
                    "instructions": stored.instructions,
                    "previous": stored.previous_response_id,
                    "total": usage.total_tokens,
                    "cached": usage.input_tokens_details.cached_tokens,
                    "lead": (stored.model_extra or {}).get("dss", {}).get("lead_update"),
                }
            )
        return turns

    return asyncio.run(run())


def test_openai_agents_instructions_with_the_time_keep_the_chain_cached_with_lead_updates(
    api_server: ApiServer,
) -> None:
    shares = {}
    for mode in ("volatile", "off"):
        turns = clock_agent_turns(api_server, f"cl-clock-{mode}", mode)
        # Each run sent instructions of its own time and chained to the run before.
        assert len({t["instructions"] for t in turns}) == len(turns), [t["instructions"] for t in turns]
        assert turns[0]["previous"] is None and all(t["previous"] for t in turns[1:])
        assert turns[0]["lead"] is None  # nothing stored to differ from
        shares[mode] = []
        for before, t in itertools.pairwise(turns):
            history = before["total"]  # the previous run's prompt and answer
            shares[mode].append(round(t["cached"] / history, 3))
            lead = t["lead"]
            assert lead is not None and lead["kind"] == "volatile", lead
            if mode == "volatile":
                assert lead["served"] is True and lead["reason"] is None, lead
                assert lead["reused_tokens"] >= 0.9 * history, (lead, history)
                assert t["cached"] >= 0.9 * history, (t, history)
            else:
                assert (lead["served"], lead["reason"]) == (False, "off"), lead
                assert t["cached"] < 0.1 * history, (t, history)
    print("cached share of the history per later run:", shares)
