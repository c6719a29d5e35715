"""One turn's steps, whatever API shapes its answer: limits, prompt, generation, commit.

Shared by `/v1/chat/completions`, the stateful `/v1/sessions/{sid}/messages` (both shaped by
`api.chat_response`) and `/v1/responses` (`api.responses`). A turn's versions are committed only
after its last token was generated (and, when streaming, sent); a client that goes away earlier
cancels the generation and nothing is committed. A turn with `n` choices commits each one as a
version: siblings under the same parent, each on a branch of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from api.engine import ChatEngine, Delta, Finished, Sampling
from api.schemas import DssInfo, GenerationParams, PromptTokensDetails, TierTokens, Usage
from api.settings import LimitsSettings
from api.state import AppState
from dss.dialogue.turns import Committed, TurnTarget, check_text, commit_alternatives
from dss.errors import LimitExceeded
from dss.jsonlimits import check_items, check_json
from dss.types import TOKEN_DTYPE, TenantId, UserId


@dataclass(frozen=True, slots=True)
class Turn:
    user: UserId
    messages: list[dict[str, Any]]  # the whole dialogue the prompt renders
    params: GenerationParams
    target: TurnTarget | None  # None: a plain chat without a session
    # The request's honoured OpenAI fields (`api.openai_fields`), converted by vLLM's request model.
    fields: Mapping[str, Any] = field(default_factory=dict)
    # False: the store neither loads nor saves this turn's KV (a Responses `store: false`).
    persist: bool = True
    # The user's erasure epoch when the turn was admitted (`admitted_epoch`): its tenant, and
    # every write it makes is refused (`UserErased`) once the user was erased since, however
    # far the turn got (prepared, generating, committing). None: whatever the epoch is then.
    epoch: int | None = None


@dataclass(frozen=True, slots=True)
class Prepared:
    prompt_ids: list[int]
    sampling: Sampling
    tenant: TenantId
    salt: str
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


async def admitted_epoch(state: AppState, user: str) -> int:
    """The user's erasure epoch as a turn is admitted, before it reads or writes anything."""
    return await asyncio.to_thread(state.store.identity.epoch_of, user)


def check_limits(
    lim: LimitsSettings,
    params: GenerationParams,
    messages: list[dict[str, Any]],
    fields: Mapping[str, Any] | None = None,
) -> None:
    """The limits table on a turn's request, before any work for it: every 400 names the field
    and the limit. `fields`: the honoured OpenAI fields passed to vLLM."""
    json_limits = lim.json_limits()
    # First: what follows (and vLLM) walks these values recursively.
    check_items("messages", messages, json_limits)
    for name, (setting, most) in lim.entry_limits().items():
        value = (fields or {}).get(name)
        if isinstance(value, Sized) and not isinstance(value, str) and len(value) > most:
            raise LimitExceeded(
                f"`{name}` has {len(value)} entries, over this server's limit of {most} ({setting})",
                field=name,
            )
    for name, value in (fields or {}).items():
        if isinstance(value, Mapping | list | tuple):
            check_json(name, value, json_limits)
    check_text(messages, "messages")
    check_text(list(params.stop or []), "stop")
    if len(messages) > lim.max_messages:
        raise LimitExceeded(f"{len(messages)} messages exceed the limit of {lim.max_messages}")
    longest = max((len(str(m.get("content") or "")) for m in messages), default=0)
    if longest > lim.max_message_chars:
        raise LimitExceeded(f"a message of {longest} characters exceeds the limit of {lim.max_message_chars}")
    stops = params.stop or []
    if len(stops) > lim.max_stop_sequences:
        raise LimitExceeded(f"{len(stops)} stop sequences exceed the limit of {lim.max_stop_sequences}")
    wanted = params.requested_max_tokens
    if wanted is not None and wanted > lim.max_output_tokens:
        raise LimitExceeded(f"max_tokens {wanted} exceeds this server's limit of {lim.max_output_tokens}")
    if params.n > lim.max_n:
        raise LimitExceeded(f"n={params.n} exceeds this server's limit of {lim.max_n} alternatives")


async def prepare(state: AppState, engine: ChatEngine, turn: Turn) -> Prepared:
    """Limits, vLLM's validation of the request, the prompt and its length: the 400s a turn can
    get before a stream starts. (What vLLM checks against the model when the request reaches
    the engine, such as `top_logprobs` above its maximum, fails in `generate`: in a stream, as
    an error event after the 200, as in vLLM's own server.)"""
    check_limits(state.settings.limits, turn.params, turn.messages, turn.fields)
    # Validated first (a malformed tool must not reach the template); max_tokens is set below.
    lim = state.settings.limits
    checked = engine.sampling(
        turn.messages, turn.fields, turn.params.requested_max_tokens or lim.default_max_tokens
    )
    if turn.target is not None and turn.target.parent is not None:
        # Start promoting the version's pages that sit on disk while the prompt is rendered.
        state.store.retention.warm_version(turn.user, turn.target.session_id, turn.target.parent)
    prompt_ids = await asyncio.to_thread(prompt_for, engine, turn, checked.tools)
    max_tokens = engine.check_length(
        len(prompt_ids), turn.params.requested_max_tokens, lim.default_max_tokens
    )
    sampling = engine.sampling(turn.messages, turn.fields, max_tokens)
    store = state.store
    if turn.epoch is not None:  # the turn's own tenant: an erasure since retired it
        tenant = store.identity.tenant_at(turn.user, turn.epoch)
        salt = store.identity.cache_salt(turn.user, turn.epoch)
    else:
        tenant = store.identity.tenant_for(turn.user)
        salt = await asyncio.to_thread(store.identity.cache_salt, turn.user)
    return Prepared(prompt_ids, sampling, tenant, salt)


def prompt_for(engine: ChatEngine, turn: Turn, tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
    """The turn's prompt token ids. A turn that extends a version continues from the version's
    stored token ids (they are what the KV cache holds); its messages stay the record for
    listings and clients. Other turns render the whole dialogue."""
    base = turn.target.base if turn.target is not None else None
    fingerprint = engine.fingerprint
    if base is not None and base.n_tokens and fingerprint is not None and base.fingerprint == fingerprint:
        n = len(base.messages)
        if len(turn.messages) > n and turn.messages[:n] == base.messages:
            ids = engine.continue_from(base.tokens.tolist(), base.messages, turn.messages[n:], tools)
            if ids is not None:
                return ids
    return engine.render(turn.messages, tools=tools)


def events(
    engine: ChatEngine, turn: Turn, prep: Prepared, arrived: float
) -> AsyncGenerator[Delta | Finished, None]:
    target = turn.target
    return engine.generate(
        prep.prompt_ids,
        prep.sampling,
        tenant=prep.tenant,
        cache_salt=prep.salt,
        session_id=target.session_id if target is not None else None,
        state_version=target.parent if target is not None else None,
        arrived=arrived,
        persist=turn.persist,
    )


async def generate_all(engine: ChatEngine, turn: Turn, prep: Prepared, arrived: float) -> list[Finished]:
    """Every choice of the turn, finished, in index order."""
    fins: list[Finished] = []
    async with engine.admitted(), contextlib.aclosing(events(engine, turn, prep, arrived)) as evs:
        async for ev in evs:
            if isinstance(ev, Finished):
                fins.append(ev)
    return sorted(fins, key=lambda f: f.index)


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
    answers: Sequence[Answer],
    then: Callable[[list[Committed]], None] | None = None,
) -> list[Committed | None]:
    """Observe the turn in the metrics and, in a session, commit each choice as a version (all
    or nothing, `commit_alternatives`): the first where the turn attaches, every other as a
    sibling on a branch of its own, so each alternative can be continued. `then` runs in the
    same worker thread right after the commit (a Responses record, say).

    The commit is the point of no return: once it has started, a client that goes away (which
    cancels the request) no longer stops it; the request waits for it and answers as usual, so
    that "nothing was committed" is only ever said when it is true."""
    fins = [a.fin for a in answers]
    observe(state, prep, fins)
    if turn.target is None:
        return [None] * len(answers)
    target = turn.target
    choices = [
        (
            np.asarray([*prep.prompt_ids, *a.fin.output_ids], dtype=TOKEN_DTYPE),
            [*turn.messages, a.stored_message],
        )
        for a in answers
    ]

    def commit_all() -> list[Committed]:
        done = commit_alternatives(
            state.store.versions, turn.user, target, choices, engine.fingerprint, turn.epoch
        )
        if then is not None:
            then(done)
        return done

    work = asyncio.ensure_future(asyncio.to_thread(commit_all))
    try:
        committed = await asyncio.shield(work)
    except asyncio.CancelledError:
        committed = await work  # finish the commit, then answer as if nobody had gone
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
    state.metrics.commits.inc(len(committed))
    return list(committed)


def observe(state: AppState, prep: Prepared, fins: Sequence[Finished]) -> None:
    info = dss_info(prep, fins)
    m = state.metrics
    m.observe_prompt(len(prep.prompt_ids), info.engine_cached_tokens, info.loaded_from.model_dump())
    m.completion_tokens.inc(sum(len(f.output_ids) for f in fins))
    ttfts = [f.ttft_s for f in fins if f.ttft_s is not None]
    if ttfts:
        m.ttft_seconds.observe(min(ttfts))
    errors = sum(f.report.store_errors for f in fins if f.report is not None)
    if errors:
        m.store_errors.inc(errors)


def usage(prep: Prepared, fins: Sequence[Finished]) -> Usage:
    """OpenAI's counting: the prompt once, every choice's output tokens."""
    n_prompt = len(prep.prompt_ids)
    n_out = sum(len(f.output_ids) for f in fins)
    return Usage(
        prompt_tokens=n_prompt,
        completion_tokens=n_out,
        total_tokens=n_prompt + n_out,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=_cached(prep, fins)),
    )


def _cached(prep: Prepared, fins: Sequence[Finished]) -> int:
    # The prompt is computed once for all choices: the choice that found the most tells.
    return min(max((f.num_cached_tokens for f in fins), default=0), len(prep.prompt_ids))


def dss_info(prep: Prepared, fins: Sequence[Finished]) -> DssInfo:
    """The split as the connector reported it (the prompt was matched once, by the connector;
    with several choices, by the one that loaded the most)."""
    cached = _cached(prep, fins)
    reports = [f.report for f in fins if f.report is not None]
    report = max(reports, key=lambda r: r.loaded_tokens, default=None)
    loaded = report.loaded_tokens if report is not None else 0
    return DssInfo(
        cached_tokens=cached,
        engine_cached_tokens=max(0, cached - loaded),
        loaded_tokens=loaded,
        loaded_from=_tiers(report.loaded_from if report else {}),
        resident=_tiers(report.found_in if report else {}),
    )


def _tiers(counts: Mapping[str, int]) -> TierTokens:
    return TierTokens(**{k: v for k, v in counts.items() if k in TierTokens.model_fields})
