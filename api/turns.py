"""One chat turn end to end: limits, prompt, generation, commit, response (JSON or SSE).

Shared by `/v1/chat/completions` and the stateful `/v1/sessions/{sid}/messages`. The version is
committed only after the last token was generated (and, when streaming, sent); a client that
goes away earlier cancels the generation and nothing is committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from api.engine import ChatEngine, Finished, Sampling
from api.errors import ApiError, BadRequest, response_for
from api.schemas import (
    AssistantMessage,
    ChatCompletion,
    Choice,
    DssInfo,
    GenerationParams,
    PromptTokensDetails,
    TierTokens,
    Usage,
)
from api.state import AppState
from dss.dialogue.turns import Committed, TurnTarget, check_text, commit_turn
from dss.errors import DSSError, LimitExceeded
from dss.index.hashing import TOKEN_DTYPE
from dss.types import TenantId, UserId

_SESSION_KEYS = ("session_id", "state_version", "parent_version", "branch")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True, slots=True)
class Turn:
    user: UserId
    messages: list[dict[str, Any]]  # the whole dialogue the prompt renders
    params: GenerationParams
    target: TurnTarget | None  # None: a plain chat without a session


@dataclass(frozen=True, slots=True)
class _Prepared:
    prompt_ids: list[int]
    sampling: Sampling
    tenant: TenantId
    salt: str
    completion_id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")


def check_limits(state: AppState, params: GenerationParams, messages: list[dict[str, Any]]) -> None:
    lim = state.settings.limits
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


async def _prepare(state: AppState, engine: ChatEngine, turn: Turn) -> _Prepared:
    check_limits(state, turn.params, turn.messages)
    if turn.target is not None and turn.target.parent is not None:
        # Start promoting the version's pages that sit on disk while the prompt is rendered.
        state.store.retention.warm_version(turn.user, turn.target.session_id, turn.target.parent)
    prompt_ids = await asyncio.to_thread(prompt_for, engine, turn)
    max_tokens = engine.check_length(
        len(prompt_ids), turn.params.requested_max_tokens, state.settings.limits.default_max_tokens
    )
    p = turn.params
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        stop=tuple(p.stop or ()),
        seed=p.seed,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
    )
    store = state.store
    tenant = store.tenant_for(turn.user)
    salt = await asyncio.to_thread(store.cache_salt, turn.user)
    return _Prepared(prompt_ids, sampling, tenant, salt)


def prompt_for(engine: ChatEngine, turn: Turn) -> list[int]:
    """The turn's prompt token ids. A turn that extends a version continues from the version's
    stored token ids (they are what the KV cache holds); its messages stay the record for
    listings and clients. Other turns render the whole dialogue."""
    base = turn.target.base if turn.target is not None else None
    fingerprint = engine.fingerprint
    if base is not None and base.n_tokens and fingerprint is not None and base.fingerprint == fingerprint:
        n = len(base.messages)
        if len(turn.messages) > n:
            ids = engine.continue_from(base.tokens.tolist(), base.messages, turn.messages[n:])
            if ids is not None:
                return ids
    return engine.render(turn.messages)


async def run_turn(state: AppState, engine: ChatEngine, turn: Turn, request: Request) -> Any:
    arrived = time.perf_counter()
    prep = await _prepare(state, engine, turn)
    engine.check_capacity()
    if turn.params.stream:
        return StreamingResponse(
            _stream(state, engine, turn, prep, arrived), media_type="text/event-stream", headers=SSE_HEADERS
        )
    fin: Finished | None = None
    async with engine.admitted(), contextlib.aclosing(_events(engine, turn, prep, arrived)) as events:
        async for ev in events:
            if isinstance(ev, Finished):
                fin = ev
    assert fin is not None
    if turn.target is not None and await request.is_disconnected():
        state.metrics.aborted.inc()
        raise BadRequest("the client went away before the turn was committed", code="client_disconnected")
    committed = await _commit(state, engine, turn, prep, fin)
    body = _completion(engine, turn, prep, fin, committed).model_dump(mode="json")
    if turn.target is None:  # a plain OpenAI answer: no session fields at all
        for key in _SESSION_KEYS:
            body.pop(key, None)
    return JSONResponse(body)


def _events(engine: ChatEngine, turn: Turn, prep: _Prepared, arrived: float) -> AsyncGenerator[Any, None]:
    target = turn.target
    return engine.generate(
        prep.prompt_ids,
        prep.sampling,
        tenant=prep.tenant,
        cache_salt=prep.salt,
        session_id=target.session_id if target is not None else None,
        state_version=target.parent if target is not None else None,
        arrived=arrived,
    )


async def _commit(
    state: AppState, engine: ChatEngine, turn: Turn, prep: _Prepared, fin: Finished
) -> Committed | None:
    _observe(state, prep, fin)
    if turn.target is None:
        return None
    tokens = np.asarray([*prep.prompt_ids, *fin.output_ids], dtype=TOKEN_DTYPE)
    messages = [*turn.messages, {"role": "assistant", "content": fin.text}]
    committed = await asyncio.to_thread(
        commit_turn,
        state.store.versions,
        turn.user,
        turn.target,
        tokens,
        messages,
        engine.fingerprint,
    )
    state.metrics.commits.inc()
    return committed


def _observe(state: AppState, prep: _Prepared, fin: Finished) -> None:
    info = _dss_info(prep, fin)
    m = state.metrics
    m.observe_prompt(len(prep.prompt_ids), info.engine_cached_tokens, info.loaded_from.model_dump())
    m.completion_tokens.inc(len(fin.output_ids))
    if fin.ttft_s is not None:
        m.ttft_seconds.observe(fin.ttft_s)
    if fin.report is not None and fin.report.store_errors:
        m.store_errors.inc(fin.report.store_errors)


def _usage(prep: _Prepared, fin: Finished) -> Usage:
    n_prompt, n_out = len(prep.prompt_ids), len(fin.output_ids)
    return Usage(
        prompt_tokens=n_prompt,
        completion_tokens=n_out,
        total_tokens=n_prompt + n_out,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=min(fin.num_cached_tokens, n_prompt)),
    )


def _dss_info(prep: _Prepared, fin: Finished) -> DssInfo:
    """The split as the connector reported it (the prompt was matched once, by the connector)."""
    cached = min(fin.num_cached_tokens, len(prep.prompt_ids))
    report = fin.report
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


def _session_fields(turn: Turn, committed: Committed | None) -> dict[str, Any]:
    if turn.target is None or committed is None:
        return {}
    return {
        "session_id": turn.target.session_id,
        "state_version": committed.version.number,
        "parent_version": committed.version.parent,
        "branch": committed.branch,
    }


def _completion(
    engine: ChatEngine, turn: Turn, prep: _Prepared, fin: Finished, committed: Committed | None
) -> ChatCompletion:
    return ChatCompletion(
        id=prep.completion_id,
        created=int(time.time()),
        model=engine.model_name,
        choices=[Choice(message=AssistantMessage(content=fin.text), finish_reason=fin.finish_reason)],
        usage=_usage(prep, fin),
        dss=_dss_info(prep, fin),
        **_session_fields(turn, committed),
    )


async def _stream(
    state: AppState, engine: ChatEngine, turn: Turn, prep: _Prepared, arrived: float
) -> AsyncIterator[str]:
    cid = prep.completion_id
    created = int(time.time())
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name}
    session = {"session_id": turn.target.session_id} if turn.target is not None else {}

    def chunk(delta: Mapping[str, Any], finish: str | None = None, **extra: Any) -> str:
        body = {
            **base,
            "choices": [{"index": 0, "delta": dict(delta), "logprobs": None, "finish_reason": finish}],
        }
        return _sse({**body, **session, **extra})

    committed_ok = False
    try:
        async with (
            engine.admitted(strict=False),
            contextlib.aclosing(_events(engine, turn, prep, arrived)) as events,
        ):
            yield chunk({"role": "assistant", "content": ""})
            fin: Finished | None = None
            async for ev in events:
                if isinstance(ev, Finished):
                    fin = ev
                else:
                    yield chunk({"content": ev.text})
            assert fin is not None
        # Every token is generated and sent; only now does the turn become a version.
        committed = await _commit(state, engine, turn, prep, fin)
        committed_ok = True
        fields = _session_fields(turn, committed)
        yield chunk({}, fin.finish_reason, **fields)
        if turn.params.include_usage:
            usage = _usage(prep, fin).model_dump()
            dss = _dss_info(prep, fin).model_dump()
            yield _sse({**base, "choices": [], "usage": usage, "dss": dss, **session, **fields})
        yield "data: [DONE]\n\n"
    except (ApiError, DSSError) as exc:
        resp = response_for(exc)
        yield _sse(json.loads(bytes(resp.body)))
    except BaseException:
        if not committed_ok and turn.target is not None:
            state.metrics.aborted.inc()
        raise


def _sse(obj: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), default=str)}\n\n"
