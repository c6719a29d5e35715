"""A turn's answer as OpenAI's Chat Completions API shapes it: one JSON body, or SSE chunks.

Used by `/v1/chat/completions` and `/v1/sessions/{sid}/messages`; the steps of the turn itself
are in `api.turn`. Choices carry log-probabilities in vLLM's format when asked for, and, in a
session, the version and branch each one became (the first choice's are also at the top level).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse, Response

from api.errors import ApiError, response_for
from api.llm.chat_engine import ChatEngine
from api.llm.generation import Finished
from api.shapes.schemas import AssistantMessage, ChatCompletion, Choice
from api.shapes.usage import dss_info, usage
from api.turn.pipeline import AfterCommit, TurnRun
from api.turn.types import Answer, Prepared, Turn
from dss.dialogue.turn_commits import Committed
from dss.errors import DSSError

_SESSION_KEYS = ("session_id", "state_version", "parent_version", "branch")
_MIN_LOGPROB = -9999.0  # as vLLM clamps -inf


class ChatReply:
    """A turn's answer as a chat completion (`api.turn.pipeline.Reply`)."""

    client_gone = "the client went away before the turn was committed"

    def after_commit(self, run: TurnRun, answers: Sequence[Answer]) -> AfterCommit | None:
        return None

    def body(
        self, run: TurnRun, answers: Sequence[Answer], committed: Sequence[Committed | None]
    ) -> Response:
        turn = run.turn
        body = _completion(run.engine, turn, run.prep, answers, committed).model_dump(mode="json")
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

    def stream(self, run: TurnRun) -> AsyncIterator[str]:
        return _stream(run)


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


def _completion(
    engine: ChatEngine,
    turn: Turn,
    prep: Prepared,
    answers: Sequence[Answer],
    committed: Sequence[Committed | None],
) -> ChatCompletion:
    fins = [a.fin for a in answers]
    choices = [
        Choice(
            index=a.fin.index,
            message=AssistantMessage(content=a.content, tool_calls=a.tool_calls or None),
            finish_reason=a.finish_reason,
            logprobs=_choice_logprobs(engine, prep, a.fin),
            stop_reason=a.fin.stop_reason,
            **_version_fields(c),
        )
        for a, c in zip(answers, committed, strict=True)
    ]
    return ChatCompletion(
        id=prep.completion_id,
        created=int(time.time()),
        model=engine.model_name,
        choices=choices,
        usage=usage(prep, fins),
        system_fingerprint=system_fingerprint(engine),
        dss=dss_info(prep, fins),
        **_session_fields(turn, committed),
    )


async def _stream(run: TurnRun) -> AsyncIterator[str]:
    state, engine, turn, prep = run.state, run.engine, run.turn, run.prep
    cid = prep.completion_id
    created = int(time.time())
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name}
    session = {"session_id": turn.target.session_id} if turn.target is not None else {}
    top_n = prep.sampling.logprobs
    buffered = prep.sampling.parse_tools  # tool calls are known only once the text is whole

    def chunk(
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
        return _sse({**base, "choices": [choice], **session, **(top or {})})

    committed_ok = False
    try:
        fins: list[Finished] = []
        async with run.events() as evs:
            for i in range(prep.sampling.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for ev in evs:
                if isinstance(ev, Finished):
                    fins.append(ev)
                elif not buffered:
                    lp = None
                    if top_n is not None:
                        lp = {"content": logprobs_content(engine, ev.token_ids, ev.logprobs, top_n)}
                    yield chunk(ev.index, {"content": ev.text}, logprobs=lp)
        fins.sort(key=lambda f: f.index)
        answers = [run.answer(f) for f in fins]
        # Every token is generated and sent; only now does the turn become versions.
        committed = await run.commit(answers)
        committed_ok = True
        fields = _session_fields(turn, committed)
        # As vLLM's server: the system fingerprint is on the usage chunk, or else the last one.
        fingerprint = {"system_fingerprint": system_fingerprint(engine)}
        with_usage = turn.params.include_usage
        for i, (a, c) in enumerate(zip(answers, committed, strict=True)):
            if buffered:
                yield chunk(a.fin.index, _buffered_delta(a), logprobs=_choice_logprobs(engine, prep, a.fin))
            last = i == len(answers) - 1  # the session's fields ride on the last chunk with a choice
            yield chunk(
                a.fin.index,
                {},
                a.finish_reason,
                top=({**fields, **({} if with_usage else fingerprint)}) if last else None,
                stop_reason=a.fin.stop_reason,
                **_version_fields(c),
            )
        if with_usage:
            use = usage(prep, fins).model_dump(exclude={"completion_tokens_details"})  # as vLLM's stream
            dss = dss_info(prep, fins).model_dump()
            yield _sse({**base, "choices": [], "usage": use, **fingerprint, "dss": dss, **session, **fields})
        yield "data: [DONE]\n\n"
    except (ApiError, DSSError) as exc:
        resp = response_for(exc)
        yield _sse(json.loads(bytes(resp.body)))
    except BaseException:
        if not committed_ok and turn.target is not None:
            state.metrics.aborted.inc()
        raise


def _buffered_delta(a: Answer) -> dict[str, Any]:
    delta: dict[str, Any] = {"content": a.content}
    if a.tool_calls:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(a.tool_calls)]
    return delta


def _sse(obj: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), default=str)}\n\n"
