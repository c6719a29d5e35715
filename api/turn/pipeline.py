"""A turn, admitted and resolved (`api.turn.request.Turn`), run: prompt → generate → answer →
commit, written once, as a stream of typed events that every API only formats (`api.shapes`).

`run_turn` yields `Started` (the prompt is built and the generation running), a `Delta` as each
choice's text arrives, `Answered` once every choice finished (tool calls split off), then `Done`
once the turn is committed: in a session each choice a version, all or nothing, after the last
token (and, streaming, after it was sent: the consumer pulls the commit). A consumer that stops
early closes the stream, which aborts the generation in the engine; nothing is committed then.
(`Failed` is what a stream reports of an error after its 200: `api.turn.respond`.)

Pages are warmed once, by the connector: it promotes the pages it loads when vLLM schedules the
request (`engine_patch.connector`). The API starts no second warm-up of the version here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from api.http_errors import ApiError
from api.llm.chat_engine import ChatEngine
from api.llm.generation import Delta, Finished, generate
from api.llm.sampling import Sampling
from api.state import AppState
from api.turn.lead import PromptPlan, plan_prompt
from api.turn.lead_gate import maybe_check
from api.turn.request import Turn
from api.turn.truncate import shortened
from dss.dialogue.response_store import ResponseRecord
from dss.dialogue.turns import Committed, add_response, commit_alternatives
from dss.errors import DSSError
from dss.tokens import TOKEN_DTYPE

log = logging.getLogger("dss.api.turn")


# ------------------------------------------------------------------------------------- the turn
@dataclass(frozen=True, slots=True)
class Prepared:
    """The turn's prompt (its ids, what the model saw, its lead's report, the messages a
    truncation left out: `api.turn.lead.PromptPlan`) and its sampling, as vLLM validated them."""

    plan: PromptPlan
    sampling: Sampling
    completion_id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")


@dataclass(frozen=True, slots=True)
class Answer:
    """One finished choice as the client sees it (tool calls split off by the parser, if any)."""

    fin: Finished
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None

    @property
    def stored_message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg

    def stored_as(self, item_id: str | None) -> dict[str, Any]:
        """`stored_message`, with the item id it is stored under when it has one."""
        return self.stored_message if item_id is None else {**self.stored_message, "id": item_id}


@dataclass(frozen=True, slots=True)
class PromptSplit:
    """Where the prompt's KV came from, as the connector reported it (the prompt was matched once,
    for every choice: the choice that found the most tells)."""

    prompt_tokens: int
    cached: int  # engine prefix cache and the store's loads
    engine_cached: int  # vLLM's own prefix cache
    loaded: int  # from the store's tiers
    loaded_from: Mapping[str, int]  # tokens per tier
    found_in: Mapping[str, int]  # where the store found them
    planned_ahead: bool = False  # the load was planned before the request went to the engine


def prompt_split(prep: Prepared, fins: Sequence[Finished]) -> PromptSplit:
    n_prompt = len(prep.plan.ids)
    cached = min(max((f.num_cached_tokens for f in fins), default=0), n_prompt)
    reports = [f.report for f in fins if f.report is not None]
    report = max(reports, key=lambda r: r.loaded_tokens, default=None)
    if report is None:
        return PromptSplit(n_prompt, cached, cached, 0, {}, {})
    loaded = report.loaded_tokens
    return PromptSplit(
        n_prompt,
        cached,
        max(0, cached - loaded),
        loaded,
        report.loaded_from,
        report.found_in,
        report.planned_ahead,
    )


# ----------------------------------------------------------------------------------- the events
@dataclass(frozen=True, slots=True)
class Started:
    """The prompt is built and the generation running: what a shape needs before any token."""

    turn: Turn
    prep: Prepared


@dataclass(frozen=True, slots=True)
class Answered:
    """Every choice finished, in index order; nothing committed yet."""

    answers: tuple[Answer, ...]


@dataclass(frozen=True, slots=True)
class Done:
    """The turn is committed (in a session each choice a version; else nothing was stored): the
    last event, with everything an answer shows."""

    turn: Turn
    prep: Prepared
    answers: tuple[Answer, ...]
    versions: tuple[Committed | None, ...]  # per answer
    split: PromptSplit
    record: ResponseRecord | None = None  # a Responses turn's


# A Responses turn's record, made from its `Done` (its one answer, the version it became:
# `api.shapes.openai_responses`) and stored with that version in the commit's one step.
RecordResponse = Callable[[Done], ResponseRecord]


@dataclass(frozen=True, slots=True)
class Failed:
    """A streamed turn's error after its 200 went out (before it: the request's own status)."""

    error: ApiError | DSSError


# `Delta` is the generation's own event (`api.llm.generation`), passed on as it is.
TurnEvent = Started | Delta | Answered | Done | Failed


# ------------------------------------------------------------------------------------ the steps
async def prepare(state: AppState, engine: ChatEngine, turn: Turn) -> Prepared:
    """vLLM's validation of the request (once), the prompt and its length: with the limits, the
    400s a turn can get before a stream starts. (What vLLM checks against the model when the
    request reaches the engine, such as `top_logprobs` above its maximum, fails in `generate`: in
    a stream, as an error event after the 200, as in vLLM's own server.)"""
    lim = state.settings.limits
    # Validated first (a malformed tool must not reach the template); max_tokens is set below,
    # once the prompt's length is known, from this same validated request.
    validated = engine.validate(turn.messages, turn.fields)
    placement = state.settings.lead.placement
    plan = await asyncio.to_thread(prompt_for, engine, turn, validated.tools, placement)
    answer_room = turn.params.max_tokens or lim.default_max_tokens
    if turn.truncate and len(plan.ids) + answer_room > engine.max_model_len:
        room = engine.max_model_len - answer_room
        cut = await asyncio.to_thread(shortened, engine, turn.messages, validated.tools, room, plan.lead)
        plan = cut or plan  # none fits: the length check below says so
    max_tokens = engine.check_length(len(plan.ids), turn.params.max_tokens, lim.default_max_tokens)
    return Prepared(plan, engine.sampling_for(validated, max_tokens))


def prompt_for(
    engine: ChatEngine, turn: Turn, tools: Sequence[Mapping[str, Any]] = (), placement: str = "note"
) -> PromptPlan:
    """The turn's prompt. A turn that extends a version continues from the version's stored
    token ids (they are what the KV cache holds), as the model saw them, with a lead update when
    its lead changed (`api.turn.lead`); its messages stay the record for listings and clients.
    Other turns render the whole dialogue."""
    return plan_prompt(engine, turn.target, turn.messages, tools, placement)


async def run_turn(
    state: AppState,
    engine: ChatEngine,
    turn: Turn,
    prep: Prepared,
    arrived: float,
    *,
    strict: bool,
    record: RecordResponse | None = None,
) -> AsyncGenerator[TurnEvent, None]:
    """The prepared turn's events, from its generation to its commit (see the module's doc).
    `strict`: fail with `EngineOverloaded` when no generation slot is free; otherwise take one
    anyway (a stream, whose capacity was checked before its 200 went out). `record`: a Responses
    turn's record maker (`commit`)."""
    fins: list[Finished] = []
    target = turn.target
    generation = generate(
        engine,
        prep.plan.ids,
        prep.sampling,
        tenant=turn.admitted.tenant,
        cache_salt=turn.admitted.salt,
        session_id=target.session_id if target is not None else None,
        arrived=arrived,
        persist=turn.persist,
    )
    async with engine.slots.admitted(strict=strict), contextlib.aclosing(generation) as events:
        yield Started(turn, prep)
        async for ev in events:
            if isinstance(ev, Finished):
                fins.append(ev)
            else:
                yield ev
    answers = tuple(answer(engine, prep, f) for f in sorted(fins, key=lambda f: f.index))
    yield Answered(answers)
    yield await commit(state, engine, turn, prep, answers, record)


def answer(engine: ChatEngine, prep: Prepared, fin: Finished) -> Answer:
    if not prep.sampling.parse_tools:
        return Answer(fin, fin.text, [], fin.finish_reason)
    content, calls = engine.tool_calls(prep.sampling, fin.text)
    return Answer(fin, content, calls, "tool_calls" if calls else fin.finish_reason)


async def commit(
    state: AppState,
    engine: ChatEngine,
    turn: Turn,
    prep: Prepared,
    answers: tuple[Answer, ...],
    record: RecordResponse | None = None,
) -> Done:
    """Observe the turn in the metrics and, in a session, commit each choice as a version (all
    or nothing, `commit_alternatives`): the first where the turn attaches, every other as a
    sibling on a branch of its own, so each alternative can be continued. A Responses turn's
    record (`record`) is added in the same worker-thread step (`add_response`: no version is
    left without its record); unstored, it is only made.

    The commit is the point of no return: once it has started, a client that goes away (which
    cancels the request) no longer stops it; the request waits for it and answers as usual, so
    that "nothing was committed" is only ever said when it is true."""
    split = prompt_split(prep, [a.fin for a in answers])
    observe(state, prep, split, answers)
    if turn.target is None:
        done = Done(turn, prep, answers, (None,) * len(answers), split)
        return replace(done, record=record(done)) if record is not None else done
    target = turn.target
    choices = [
        (
            np.asarray([*prep.plan.ids, *a.fin.output_ids], dtype=TOKEN_DTYPE),
            [*turn.messages, a.stored_as(turn.answer_item_id)],
        )
        for a in answers
    ]
    versions, responses = state.store.versions, state.store.responses
    epoch = turn.admitted.epoch

    def commit_all() -> Done:
        wait_until_shared(state, turn)
        seen = prep.plan.seen
        committed = commit_alternatives(versions, turn.user, target, choices, engine.fingerprint, epoch, seen)
        done = Done(turn, prep, answers, tuple(committed), split)
        if record is None:
            return done
        kept = record(done)
        add_response(versions, responses, kept, epoch)
        return replace(done, record=kept)

    work = asyncio.ensure_future(asyncio.to_thread(commit_all))
    try:
        done = await asyncio.shield(work)
    except asyncio.CancelledError:
        done = await work  # finish the commit, then answer as if nobody had gone
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
    state.metrics.commits.inc(len(done.versions))
    maybe_check(state, engine, turn, prep.plan)
    return done


def wait_until_shared(state: AppState, turn: Turn) -> None:
    """In a fleet, a version is committed only once its pages reached the remote tier (bounded by
    `remote_durable_wait_s`): the session's next turn on any server (a failover, a rebalance)
    finds all of it, even if this server dies right after answering. A wait that runs out is
    logged and counted, and the version committed anyway (its last pages are then a miss)."""
    began = time.perf_counter()
    shared = state.store.kv.wait_shared(turn.admitted.tenant)
    if shared is None:
        return
    m = state.metrics
    m.shared_tier_wait_seconds.inc(time.perf_counter() - began)
    m.shared_tier_waits.labels("durable" if shared else "timeout").inc()
    if not shared:
        log.warning("a turn's pages did not all reach the remote tier in time; committed anyway")


def observe(state: AppState, prep: Prepared, split: PromptSplit, answers: Sequence[Answer]) -> None:
    m = state.metrics
    m.observe_prompt(split.prompt_tokens, split.engine_cached, dict(split.loaded_from), split.planned_ahead)
    lead = prep.plan.lead
    if lead is not None:
        m.observe_lead(lead.served, lead.reason, lead.update_tokens)
    fins = [a.fin for a in answers]
    m.completion_tokens.inc(sum(len(f.output_ids) for f in fins))
    ttfts = [f.ttft_s for f in fins if f.ttft_s is not None]
    if ttfts:
        m.ttft_seconds.observe(min(ttfts))
    errors = sum(f.report.store_errors for f in fins if f.report is not None)
    if errors:
        m.store_errors.inc(errors)
