"""The OpenAI Responses API on DSS versions: request bodies, the response object, its stream.

A stored response is a version of a session (`dss.dialogue.response_store`): one session per chain,
`previous_response_id` continues a response's version, and continuing an older one than the
newest forks a branch. So responses survive restarts, their KV cache is served from the store on
the next turn, and they are erased with their user. `store: false` answers without keeping
anything: no version, no record (`GET` then answers 404). With `conversation` (exclusive with
`previous_response_id`), the response is the next version of that conversation's `main`
(`dss.dialogue.conversations`).

The response object follows OpenAI's (`created_at` is a Unix time there, as in OpenAI's API);
DSS adds `dss`: the session, version and branch the response became, and where its prompt's KV
came from. Streams send OpenAI's event types, each `event: <type>` with its JSON `data`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.http_errors import BadRequest, response_for
from api.llm.chat_engine import ChatEngine
from api.llm.generation import Delta
from api.shapes.openai_fields import check_fields
from api.shapes.schemas import LeadUpdatesField, join_text
from api.shapes.usage import dss_info
from api.turn.pipeline import Done, Failed, Started, TurnEvent
from dss.dialogue.response_store import ResponseRecord, new_response_id
from dss.jsonlimits import JsonLimits, check_items, check_json
from dss.types import SessionId, UserId

RESPONSE_ID_PATTERN = r"^resp_[0-9a-f]{48}$"
_MAX_METADATA_KEYS = 16

# Fields of a Responses request that this server honours; the rest of OpenAI's pass only at their
# no-op values (`RESPONSES_REFUSED`).
RESPONSES_HONOURED: frozenset[str] = frozenset(
    {
        "model",
        "input",
        "instructions",
        "previous_response_id",
        "conversation",
        "store",
        "stream",
        "max_output_tokens",
        "temperature",
        "top_p",
        "metadata",
        "user",
        "safety_identifier",
        "text",
    }
)
RESPONSES_REFUSED: Mapping[str, str] = {
    "tools": "tools are not served on /v1/responses",
    "tool_choice": "tools are not served on /v1/responses",
    "max_tool_calls": "tools are not served on /v1/responses",
    "include": "no optional output data is served",
    "top_logprobs": "log-probabilities are served on /v1/chat/completions",
    "reasoning": "the model does not reason",
    "background": "responses are answered in the foreground",
    "prompt": "prompt templates are not served",
    "service_tier": "this server has one tier",
    "prompt_cache_key": "every stored response is cached with its chain",
    "prompt_cache_retention": "retention is set per session (PATCH /v1/sessions/{id})",
    "stream_options": "not served",
    "parallel_tool_calls": "tools are not served on /v1/responses",
}
_NO_OP: Mapping[str, tuple[Any, ...]] = {
    "tool_choice": ("auto", "none", None),
    "service_tier": ("auto", "default", None),
    "parallel_tool_calls": (True, False, None),
}


# ------------------------------------------------------------------------------------------ request
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ContentPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = Field(default=None, max_length=128)
    status: str | None = None

    def text(self) -> str:
        return join_text(self.content)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(default=None, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a plain model gives


class ConversationRef(_Strict):
    id: str = Field(max_length=128)


class ResponseCreate(BaseModel):
    """`POST /v1/responses`. Fields OpenAI defines but this server does not serve are refused with
    a 400 naming them (unless at their no-op value); unknown fields likewise."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[InputMessage]
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, pattern=RESPONSE_ID_PATTERN)
    # The conversation the response belongs to (`api.routes.conversations`): its id, or `{"id"}`.
    conversation: str | ConversationRef | None = Field(default=None)
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = None
    user: str | None = Field(default=None, max_length=256)
    # OpenAI's stable id of the end user; on a frontend key it may name the end user (`api.end_users`).
    safety_identifier: str | None = Field(default=None, max_length=256)
    text: TextConfig | None = None
    # "auto": a dialogue that outgrew the context is shortened from its front, in large steps
    # (`api.turn.truncate`); "disabled": it is refused with a 400, as in OpenAI's API.
    truncation: Literal["disabled", "auto"] = "disabled"
    lead_updates: LeadUpdatesField = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(v)

    @property
    def conversation_id(self) -> SessionId | None:
        c = self.conversation
        return SessionId(c if isinstance(c, str) else c.id) if c is not None else None

    def check_fields(self) -> None:
        """Refuse (400) what is not served, and `conversation` with what contradicts it: with
        `previous_response_id` (mutually exclusive, as in OpenAI's API) or with `store: false` (a
        response in a conversation is stored in it)."""
        extras = dict(self.model_extra or {})
        check_fields(extras, own=(), honoured=RESPONSES_HONOURED, refused=RESPONSES_REFUSED, no_op=_NO_OP)
        if self.conversation is None:
            return
        if self.previous_response_id is not None:
            raise BadRequest(
                "Mutually exclusive parameters: Ensure you are only providing one of: "
                "'previous_response_id' or 'conversation'.",
                code="mutually_exclusive_parameters",
                param="conversation",
            )
        if not self.store:
            raise BadRequest(
                "a response in a conversation is stored in it: `store: false` cannot be used with "
                "`conversation`",
                param="store",
            )

    def items(self) -> list[InputMessage]:
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return list(self.input)

    def sampling_fields(self) -> dict[str, Any]:
        """The request as vLLM's chat request fields (`api.shapes.openai_fields.HONOURED_CHAT`)."""
        out: dict[str, Any] = {}
        if self.max_output_tokens is not None:
            out["max_tokens"] = self.max_output_tokens
        if self.temperature is not None:
            out["temperature"] = self.temperature
        if self.top_p is not None:
            out["top_p"] = self.top_p
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            out["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name or "response", "schema": fmt.schema_ or {}, "strict": fmt.strict}
            out["response_format"] = {"type": "json_schema", "json_schema": schema}
        return out

    def text_config(self) -> dict[str, Any]:
        fmt = self.text.format if self.text is not None and self.text.format is not None else TextFormat()
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


def check_metadata(v: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's rule on `metadata`: at most 16 keys of 64 characters, values of 512."""
    if v is not None:
        if len(v) > _MAX_METADATA_KEYS:
            raise ValueError(f"metadata holds at most {_MAX_METADATA_KEYS} keys")
        if any(len(k) > 64 or len(x) > 512 for k, x in v.items()):
            raise ValueError("metadata keys are at most 64 characters, values at most 512")
    return v


def stored_items(items: Sequence[InputMessage]) -> list[dict[str, Any]]:
    """The input items as `input_items` lists them: as given, each with an id (made here when it
    had none) and its content as parts (a string becomes one text part)."""
    out = []
    for item in items:
        kind = "output_text" if item.role == "assistant" else "input_text"
        parts = (
            [{"type": kind, "text": item.content}]
            if isinstance(item.content, str)
            else [p.model_dump(exclude_none=True) for p in item.content]
        )
        out.append(
            {
                "id": item.id or f"msg_{uuid.uuid4().hex}",
                "type": "message",
                "role": item.role,
                "status": item.status or "completed",
                "content": parts,
            }
        )
    return out


def item_messages(items: Sequence[InputMessage]) -> list[dict[str, Any]]:
    """The input items as chat messages (a developer message is the template's system role)."""
    return [{"role": "system" if i.role == "developer" else i.role, "content": i.text()} for i in items]


# ---------------------------------------------------------------------------------- the response
@dataclass(frozen=True, slots=True)
class ResponsePlan:
    """What a response needs besides its turn, fixed before it is generated."""

    body: ResponseCreate
    input_items: list[dict[str, Any]]
    id: str = field(default_factory=new_response_id)
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    item_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")  # its output message

    def check_json(self, limits: JsonLimits) -> None:
        """The request's JSON its record will store (the input items' parts and annotations,
        `text.format.schema`) against the limits, before anything is generated: the store checks
        the record again, but only once the answer exists."""
        check_items("input", self.input_items, limits)
        check_json("text", self.body.text_config(), limits)


def response_body(record: ResponseRecord) -> dict[str, Any]:
    """The OpenAI response object of a record."""
    p = record.params
    return {
        "id": record.id,
        "object": "response",
        "created_at": int(record.created_at.timestamp()),
        "status": record.status,
        "completed_at": p.get("completed_at"),
        "error": None,
        "incomplete_details": p.get("incomplete_details"),
        "instructions": record.instructions,
        "max_output_tokens": p.get("max_output_tokens"),
        "model": record.model,
        "output": record.output,
        "parallel_tool_calls": False,
        "previous_response_id": record.previous_response_id,
        "conversation": p.get("conversation"),
        "reasoning": {"effort": None, "summary": None},
        "store": p.get("store", True),
        "temperature": p.get("temperature"),
        "text": p.get("text", {"format": {"type": "text"}}),
        "tool_choice": "none",
        "tools": [],
        "top_p": p.get("top_p"),
        "truncation": p.get("truncation", "disabled"),
        "usage": record.usage or None,
        "user": p.get("user"),
        "metadata": p.get("metadata") or {},
        "dss": p.get("dss"),
    }


def response_record(plan: ResponsePlan, model: str, done: Done) -> ResponseRecord:
    """The record of a response: its (one) answer, and the version it became (if stored)."""
    turn, ans, committed = done.turn, done.answers[0], done.versions[0]
    fin = ans.fin
    complete = fin.finish_reason != "length"
    body = plan.body
    session_id = turn.target.session_id if turn.target is not None else None
    n_prompt, n_out = done.split.prompt_tokens, len(fin.output_ids)
    info = dss_info(done)
    dss: dict[str, Any] = {"cached_tokens": info.cached_tokens, "loaded_tokens": info.loaded_tokens}
    if info.lead_update is not None:
        dss["lead_update"] = info.lead_update.model_dump()
    if info.truncated_messages:
        dss["truncated_messages"] = info.truncated_messages
    if committed is not None:
        dss |= {"session_id": session_id, "version": committed.version.number, "branch": committed.branch}
    return ResponseRecord(
        id=plan.id,
        user=turn.user,
        session_id=session_id or SessionId(""),
        version=committed.version.number if committed is not None else 0,
        previous_response_id=body.previous_response_id,
        # When it was committed: an erasure's verification dates what it finds by this.
        created_at=datetime.now(UTC),
        model=model,
        status="completed" if complete else "incomplete",
        instructions=body.instructions,
        input_items=plan.input_items,
        output=[_output_message(ans.content or "", "completed" if complete else "incomplete", plan.item_id)],
        usage={
            "input_tokens": n_prompt,
            "input_tokens_details": {"cached_tokens": info.cached_tokens},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_prompt + n_out,
        },
        params={
            "store": body.store,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata,
            "user": body.user,
            "text": body.text_config(),
            "incomplete_details": None if complete else {"reason": "max_output_tokens"},
            "completed_at": int(time.time()),
            "conversation": _conversation(body),
            "truncation": body.truncation,
            "dss": dss,
        },
    )


def _conversation(body: ResponseCreate) -> dict[str, str] | None:
    cid = body.conversation_id
    return {"id": cid} if cid is not None else None


def _output_message(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


# ------------------------------------------------------------------------------------ the shape
class ResponseShape:
    """A turn's events as a Responses response (`api.turn.respond.Shape`). Its record is made by
    `record` (the turn stores it with its version in one step: `api.turn.pipeline.commit`)."""

    client_gone = "the client went away before the response was stored"

    def __init__(self, plan: ResponsePlan, engine: ChatEngine, user: UserId) -> None:
        self.plan = plan
        self.model = engine.model_name
        self.user = user

    def record(self, done: Done) -> ResponseRecord:
        return response_record(self.plan, self.model, done)

    def body(self, done: Done) -> Response:
        assert done.record is not None, "a Responses turn makes its record"
        return JSONResponse(response_body(done.record))

    def stream(self, events: AsyncIterator[TurnEvent]) -> AsyncGenerator[str, None]:
        return _stream(self.plan, self.model, self.user, events)


def _event(kind: str, seq: int, **data: Any) -> str:
    body = {"type": kind, "sequence_number": seq, **data}
    return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'), default=str)}\n\n"


async def _stream(
    plan: ResponsePlan, model: str, user: UserId, events: AsyncIterator[TurnEvent]
) -> AsyncGenerator[str, None]:
    seq = iter(range(1 << 62))
    pending = ResponseRecord(
        id=plan.id,
        user=user,
        session_id=SessionId(""),
        version=0,
        previous_response_id=plan.body.previous_response_id,
        created_at=plan.created_at,
        model=model,
        status="in_progress",
        instructions=plan.body.instructions,
        input_items=plan.input_items,
        output=[],
        usage={},
        params={
            "store": plan.body.store,
            "text": plan.body.text_config(),
            "metadata": plan.body.metadata,
            "conversation": _conversation(plan.body),
        },
    )
    item_id = plan.item_id
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    text: list[str] = []
    async for ev in events:
        if isinstance(ev, Started):
            yield _event("response.created", next(seq), response=response_body(pending))
            yield _event("response.in_progress", next(seq), response=response_body(pending))
            yield _event(
                "response.output_item.added",
                next(seq),
                output_index=0,
                item={**_output_message("", "in_progress", item_id), "content": []},
            )
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield _event("response.content_part.added", next(seq), part=part, **where)
        elif isinstance(ev, Delta) and ev.text:
            text.append(ev.text)
            yield _event("response.output_text.delta", next(seq), delta=ev.text, logprobs=[], **where)
        elif isinstance(ev, Done):
            assert ev.record is not None, "a Responses turn makes its record"
            done = "".join(text)
            final_part = {"type": "output_text", "text": done, "annotations": [], "logprobs": []}
            yield _event("response.output_text.done", next(seq), text=done, logprobs=[], **where)
            yield _event("response.content_part.done", next(seq), part=final_part, **where)
            item = ev.record.output[0]
            yield _event("response.output_item.done", next(seq), output_index=0, item=item)
            # `response.completed` ends every stream, with the response's own status (`incomplete`
            # at max_output_tokens), as vLLM's server does: the openai client waits for it only.
            yield _event("response.completed", next(seq), response=response_body(ev.record))
        elif isinstance(ev, Failed):
            err = json.loads(bytes(response_for(ev.error).body))["error"]
            yield _event("error", next(seq), code=err["code"], message=err["message"], param=err["param"])
            # Then the response itself, failed, so that a client waiting for the final one gets it.
            failed = {**response_body(pending), "status": "failed"}
            failed["error"] = {"code": err["code"], "message": err["message"]}
            yield _event("response.failed", next(seq), response=failed)
