"""Request and response bodies of the REST API (pydantic), separate from the database models: the
shared parts (errors, lists, messages) and Chat Completions; the store's own resources are
`api.shapes.resources`.

Management requests ignore unknown fields. Generation requests keep every field they are sent and
check it against `api.shapes.openai_fields`: honoured through vLLM, or refused with a 400 that names it
(`tenant`, `kv_transfer_params` and the like are derived on the server only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Generic, Literal, Protocol, TypeAlias, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dss.types import SessionId

T = TypeVar("T")

Role = Literal["system", "developer", "user", "assistant", "tool"]
NAME_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"


class _HasText(Protocol):
    text: str


def join_text(content: str | Sequence[_HasText]) -> str:
    """A message's text: its string, or its text parts joined with newlines, as vLLM (and
    OpenAI) join them."""
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


class LenientRequest(BaseModel):
    """A management request body: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")


# ------------------------------------------------------------------------------------------- errors
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# --------------------------------------------------------------------------------------------- lists
class ListResponse(BaseModel, Generic[T]):
    """A page of a list. `first_id` and `last_id` name its first and last item (the item's `id`; a
    branch's `name`, a version's `number`), filled in from `data` unless given; `null` only for an
    empty page."""

    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None

    @model_validator(mode="after")
    def _ends(self) -> ListResponse[T]:
        if self.data:
            if self.first_id is None:
                self.first_id = _item_id(self.data[0])
            if self.last_id is None:
                self.last_id = _item_id(self.data[-1])
        return self


def _item_id(item: object) -> str | None:
    for attr in ("id", "name", "number"):
        value = getattr(item, attr, None)
        if value is not None:
            return str(value)
    return None


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool = True


# ---------------------------------------------------------------------------------------------- chat
class TextPart(LenientRequest):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = "text"
    text: str


class ChatMessage(LenientRequest):
    """One message. Unknown keys are refused (a 400 naming them), not dropped."""

    model_config = ConfigDict(extra="forbid")
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[dict[str, Any]] | None = Field(default=None, description="an assistant's tool calls")
    tool_call_id: str | None = Field(default=None, max_length=256, description="the call a tool answers")
    # What a client echoes back of an answer it got (the template renders none of it).
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return join_text(self.content)

    def plain(self) -> dict[str, Any]:
        """The message as stored in a version: role and text content (and the name, the tool
        calls or the answered call's id, if any)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(LenientRequest):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class GenerationParams(LenientRequest):
    """Sampling parameters shared by `/v1/chat/completions` and `/v1/sessions/{sid}/messages`.

    The fields typed here are the ones DSS itself reads; every other field is kept as given and
    checked against `api.shapes.openai_fields` (honoured through vLLM's own request model, or refused
    with a 400 that names it)."""

    model_config = ConfigDict(extra="allow")

    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    n: int = Field(default=1, ge=1, description="alternatives; in a session each becomes a sibling version")
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def request_fields(self, exclude: set[str]) -> dict[str, Any]:
        """The fields the client set (extras included), less `exclude` (the route's own)."""
        return {k: v for k, v in self.model_dump(exclude_unset=True).items() if k not in exclude}


LeadUpdatesField: TypeAlias = Annotated[
    Literal["off", "volatile", "any"] | None,
    Field(
        description="this turn's lead updates (off, volatile, any), over the key's setting: a "
        "system prompt that changed is stated after the stored history (docs/frontends.md)"
    ),
]


class ChatCompletionRequest(GenerationParams):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    user: str | None = Field(default=None, max_length=256)
    # OpenAI's stable id of the end user; on a frontend key it may name the end user (`api.end_users`).
    safety_identifier: str | None = Field(default=None, max_length=256)
    # Or the X-DSS-Session header (`api.deps.session_id_of`); `state_version` needs one of them.
    session_id: str | None = Field(default=None, pattern=NAME_PATTERN)
    state_version: int | None = Field(default=None, ge=1, le=2**31 - 1)
    lead_updates: LeadUpdatesField = None


class SessionMessageRequest(GenerationParams):
    content: str | list[TextPart]
    branch: str | None = Field(default=None, pattern=NAME_PATTERN)
    version: int | None = Field(default=None, ge=1, le=2**31 - 1)
    user: str | None = Field(default=None, max_length=256)
    truncation: Literal["disabled", "auto"] = Field(
        default="disabled",
        description="auto: a dialogue that outgrew the context is shortened from its front, in large "
        "steps at message boundaries, so later turns extend the same prefix from cache",
    )

    @model_validator(mode="after")
    def _one_base(self) -> SessionMessageRequest:
        if self.branch is not None and self.version is not None:
            raise ValueError("give either branch or version, not both")
        return self

    def text(self) -> str:
        return join_text(self.content)


class AssistantMessage(BaseModel):
    """OpenAI's fields as vLLM's server sends them (`tool_calls` only when there are any)."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = Field(
        default=None, description='`{"content": [...]}` when the request asked for logprobs'
    )
    stop_reason: int | str | None = None
    state_version: int | None = Field(default=None, description="the version this alternative became")
    branch: str | None = Field(default=None, description="the branch that version is the head of")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: dict[str, Any] | None = None


class TierTokens(BaseModel):
    host: int = 0
    disk: int = 0
    remote: int = 0  # the fleet's shared tier (Redis), when configured


class LeadUpdateInfo(BaseModel):
    """A turn whose lead (system prompt, instructions) differs from the stored version's it
    extends (docs/frontends.md, "Volatile system prompts")."""

    served: bool = Field(description="the stored history's KV was kept and the change stated after it")
    reason: str | None = Field(description="why not served: off, changed_beyond_volatile_values, ...")
    kind: str | None = Field(description="volatile (only volatile values changed) or prompt")
    changed: list[dict[str, str]] = Field(description="each changed volatile value: old and new")
    placement: str | None = Field(description="system (a late system message) or note (in the user message)")
    update: str | None = Field(description="the text the model was told after the history")
    update_tokens: int = Field(description="the update's tokens")
    reused_tokens: int = Field(description="stored history tokens the prompt continued from")


class DssInfo(BaseModel):
    """Where the prompt's KV came from. `cached_tokens` = `engine_cached_tokens` + `loaded_tokens`."""

    cached_tokens: int = Field(description="prompt tokens not recomputed (engine cache and DSS together)")
    engine_cached_tokens: int = Field(description="prompt tokens found in the engine's own prefix cache")
    loaded_tokens: int = Field(description="prompt tokens loaded from DSS by the connector")
    loaded_from: TierTokens = Field(description="DSS-loaded tokens by the tier they were read from")
    resident: TierTokens = Field(
        description="prompt tokens the connector found in each DSS tier beyond the engine's cache"
    )
    lead_update: LeadUpdateInfo | None = Field(
        default=None, description="present when the turn's lead differs from the stored version's"
    )
    truncated_messages: int = Field(
        default=0, description='history messages left out of the prompt (`truncation: "auto"`)'
    )
    echoed_answers: int = Field(
        default=0,
        description="earlier answers the client sent back with the whitespace around them trimmed, "
        "matched to the stored answers and continued from as generated",
    )


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    service_tier: str | None = None
    system_fingerprint: str | None = Field(default=None, description="the model fingerprint DSS stores under")
    session_id: SessionId | None = None
    state_version: int | None = None
    parent_version: int | None = None
    branch: str | None = None
    dss: DssInfo | None = None
