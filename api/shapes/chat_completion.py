"""A turn's answer as OpenAI's Chat Completions API shapes it: one JSON body, or SSE chunks.

Used by `/v1/chat/completions` and `/v1/sessions/{sid}/messages`; the steps of the turn itself
are in `api.turn`. Choices carry log-probabilities in vLLM's format when asked for, and, in a
session, the version and branch each one became (the first choice's are also at the top level).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse, Response

from api.http_errors import response_for
from api.llm.chat_engine import ChatEngine
from api.llm.generation import Delta, Finished
from api.shapes.schemas import AssistantMessage, ChatCompletion, Choice, GenerationParams
from api.shapes.usage import dss_info, usage
from api.turn.pipeline import Answer, Done, Failed, Prepared, Started, TurnEvent
from api.turn.request import Turn, TurnParams
from dss.dialogue.turns import Committed

_SESSION_KEYS = ("session_id", "state_version", "parent_version", "branch")
_MIN_LOGPROB = -9999.0  # as vLLM clamps -inf


def turn_params(body: GenerationParams) -> TurnParams:
    """What the turn reads of a chat request's generation fields."""
    return TurnParams(max_tokens=body.requested_max_tokens, stop=tuple(body.stop or ()), n=body.n)


class ChatCompletionShape:
    """A turn's events as a chat completion (`api.turn.respond.Shape`). `include_usage`: the
    request's `stream_options.include_usage` (a stream's usage chunk)."""

    client_gone = "the client went away before the turn was committed"
    record = None  # a chat completion keeps no record besides its versions

    def __init__(self, engine: ChatEngine, include_usage: bool = False) -> None:
        self.engine = engine
        self.include_usage = include_usage

    def body(self, done: Done) -> Response:
        turn = done.turn
        body = _completion(self.engine, done).model_dump(mode="json")
        for choice in body["choices"]:
            if not choice["message"]["tool_calls"]:
                del choice["message"]["tool_calls"]
        if turn.target is None:  # a plain OpenAI answer: no session fields at all
            for key in _SESSION_KEYS:
                body.pop(key, None)
            for choice in body["choices"]:
                choice.pop("state_version", None)
                choice.pop("branch", None)
        return JSONResponse(body)

    def stream(self, events: AsyncIterator[TurnEvent]) -> AsyncGenerator[str, None]:
        return _ChunkStream(self.engine, self.include_usage).format(events)


def system_fingerprint(engine: ChatEngine) -> str | None:
    """OpenAI's `system_fingerprint`: here the model fingerprint the turn's KV is stored under."""
    return f"dss-{engine.fingerprint[:16]}" if engine.fingerprint else None


def logprobs_content(
    engine: ChatEngine, token_ids: Sequence[int], steps: Sequence[Any] | None, top_n: int | None
) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content` for `token_ids`, as vLLM's own server writes it: the sampled
    token's text, log-probability and UTF-8 bytes, and the first `top_n` entries of each step."""
    out: list[dict[str, Any]] = []
    for i, tid in enumerate(token_ids):
        step: Mapping[int, Any] | None = steps[i] if steps is not None and i < len(steps) else None
        chosen = step.get(tid) if step is not None else None
        if step is None or chosen is None:
            token = engine.token_text(tid)
            out.append({"token": token, "logprob": _MIN_LOGPROB, "bytes": _bytes(token), "top_logprobs": []})
            continue
        token = _decoded(engine, tid, chosen)
        tops = [
            {
                "token": (t := _decoded(engine, k, lp)),
                "logprob": max(lp.logprob, _MIN_LOGPROB),
                "bytes": _bytes(t),
            }
            for j, (k, lp) in enumerate(step.items())
            if top_n is not None and (top_n == -1 or j < top_n)  # -1: every entry, as in vLLM
        ]
        out.append(
            {
                "token": token,
                "logprob": max(chosen.logprob, _MIN_LOGPROB),
                "bytes": _bytes(chosen.decoded_token) if chosen.decoded_token is not None else None,
                "top_logprobs": tops,
            }
        )
    return out


def _decoded(engine: ChatEngine, tid: int, lp: Any) -> str:
    return str(lp.decoded_token) if lp.decoded_token is not None else engine.token_text(tid)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def _choice_logprobs(engine: ChatEngine, prep: Prepared, fin: Finished) -> dict[str, Any] | None:
    if prep.sampling.logprobs is None:
        return None
    return {"content": logprobs_content(engine, fin.output_ids, fin.logprobs, prep.sampling.logprobs)}


def _version_fields(committed: Committed | None) -> dict[str, Any]:
    if committed is None:
        return {}
    return {"state_version": committed.version.number, "branch": committed.branch}


def _session_fields(turn: Turn, committed: Sequence[Committed | None]) -> dict[str, Any]:
    first = committed[0] if committed else None
    if turn.target is None or first is None:
        return {}
    return {
        "session_id": turn.target.session_id,
        "state_version": first.version.number,
        "parent_version": first.version.parent,
        "branch": first.branch,
    }


def _completion(engine: ChatEngine, done: Done) -> ChatCompletion:
    prep = done.prep
    use, info = usage(done), dss_info(done)
    choices = [
        Choice(
            index=a.fin.index,
            message=AssistantMessage(content=a.content, tool_calls=a.tool_calls or None),
            finish_reason=a.finish_reason,
            logprobs=_choice_logprobs(engine, prep, a.fin),
            stop_reason=a.fin.stop_reason,
            **_version_fields(c),
        )
        for a, c in zip(done.answers, done.versions, strict=True)
    ]
    return ChatCompletion(
        id=prep.completion_id,
        created=int(time.time()),
        model=engine.model_name,
        choices=choices,
        usage=use,
        system_fingerprint=system_fingerprint(engine),
        dss=info,
        **_session_fields(done.turn, done.versions),
    )


class _ChunkStream:
    """One stream's SSE chunks, as vLLM's server writes them: a role chunk per choice, a chunk
    per delta (or, with a tool parser, each choice's text whole once it is known), a finish chunk
    per choice carrying the version it became, the usage chunk when asked for, `[DONE]`; an
    error after the 200 as an error chunk."""

    def __init__(self, engine: ChatEngine, include_usage: bool) -> None:
        self.engine = engine
        self.include_usage = include_usage
        self.base: dict[str, Any] = {}
        self.session: dict[str, Any] = {}

    async def format(self, events: AsyncIterator[TurnEvent]) -> AsyncGenerator[str, None]:
        prep: Prepared | None = None
        async for ev in events:
            if isinstance(ev, Started):
                prep = ev.prep
                for text in self._started(ev):
                    yield text
            elif isinstance(ev, Delta) and prep is not None and not prep.sampling.parse_tools:
                top_n = prep.sampling.logprobs
                lp = None
                if top_n is not None:
                    lp = {"content": logprobs_content(self.engine, ev.token_ids, ev.logprobs, top_n)}
                yield self._chunk(ev.index, {"content": ev.text}, logprobs=lp)
            elif isinstance(ev, Done):
                for text in self._done(ev):
                    yield text
            elif isinstance(ev, Failed):
                yield _sse(json.loads(bytes(response_for(ev.error).body)))

    def _started(self, ev: Started) -> list[str]:
        turn, prep = ev.turn, ev.prep
        self.base = {
            "id": prep.completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.engine.model_name,
        }
        self.session = {"session_id": turn.target.session_id} if turn.target is not None else {}
        return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(prep.sampling.n)]

    def _done(self, done: Done) -> list[str]:
        prep = done.prep
        buffered = prep.sampling.parse_tools  # tool calls are known only once the text is whole
        fields = _session_fields(done.turn, done.versions)
        # As vLLM's server: the system fingerprint is on the usage chunk, or else the last one.
        fingerprint = {"system_fingerprint": system_fingerprint(self.engine)}
        out = []
        answers = done.answers
        for i, (a, c) in enumerate(zip(answers, done.versions, strict=True)):
            if buffered:
                lp = _choice_logprobs(self.engine, prep, a.fin)
                out.append(self._chunk(a.fin.index, _buffered_delta(a), logprobs=lp))
            last = i == len(answers) - 1  # the session's fields ride on the last chunk with a choice
            out.append(
                self._chunk(
                    a.fin.index,
                    {},
                    a.finish_reason,
                    top=({**fields, **({} if self.include_usage else fingerprint)}) if last else None,
                    stop_reason=a.fin.stop_reason,
                    **_version_fields(c),
                )
            )
        if self.include_usage:
            use = usage(done).model_dump(exclude={"completion_tokens_details"})  # as vLLM's stream
            dss = dss_info(done).model_dump()
            out.append(
                _sse(
                    {
                        **self.base,
                        "choices": [],
                        "usage": use,
                        **fingerprint,
                        "dss": dss,
                        **self.session,
                        **fields,
                    }
                )
            )
        out.append("data: [DONE]\n\n")
        return out

    def _chunk(
        self,
        index: int,
        delta: Mapping[str, Any],
        finish: str | None = None,
        logprobs: Any = None,
        top: Mapping[str, Any] | None = None,
        **extra: Any,
    ) -> str:
        choice = {
            "index": index,
            "delta": dict(delta),
            "logprobs": logprobs,
            "finish_reason": finish,
            **extra,
        }
        return _sse({**self.base, "choices": [choice], **self.session, **(top or {})})


def _buffered_delta(a: Answer) -> dict[str, Any]:
    delta: dict[str, Any] = {"content": a.content}
    if a.tool_calls:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(a.tool_calls)]
    return delta


def _sse(obj: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), default=str)}\n\n"
