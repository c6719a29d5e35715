"""Request and response bodies of the REST API (pydantic), separate from the database models.

Management requests ignore unknown fields. Generation requests keep every field they are sent and
check it against `api.shapes.openai_fields`: honoured through vLLM, or refused with a 400 that names it
(`tenant`, `kv_transfer_params` and the like are derived on the server only).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
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


class _Request(BaseModel):
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
class TextPart(_Request):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = "text"
    text: str


class ChatMessage(_Request):
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


class StreamOptions(_Request):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class GenerationParams(_Request):
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


# ------------------------------------------------------------------------------------------ sessions
class SessionCreate(_Request):
    session_id: str | None = Field(default=None, pattern=NAME_PATTERN)
    system_prompt: str | None = None
    metadata: dict[str, Any] | None = None


class BranchOut(BaseModel):
    object: Literal["session.branch"] = "session.branch"
    name: str
    head_version: int = Field(description="0 while the branch has no versions")
    created_at: datetime


KvRetention = Literal["pinned", "normal", "evict"]
MAX_IDLE_TTL_S = 30 * 24 * 3600  # dss.dialogue.versions.MAX_IDLE_TTL_S


class SessionOut(BaseModel):
    id: SessionId
    object: Literal["session"] = "session"
    created_at: datetime
    updated_at: datetime
    system_prompt: str | None
    metadata: dict[str, Any]
    version_count: int
    branches: list[BranchOut]
    stored_bytes: int = Field(
        default=0,
        description="KV bytes stored for the session's versions: each page once, uncompressed, in any "
        "tier; pages shared with the user's other sessions count in each, public prefixes in none",
    )
    kv_retention: KvRetention = Field(default="normal", description="the session's KV retention hint")
    kv_idle_ttl_s: int | None = Field(
        default=None, description="idle seconds after which its host KV pages move to disk; null: never"
    )


class SessionPatch(_Request):
    """Fields left out stay as they are; `kv_idle_ttl_s: null` clears the TTL."""

    kv_retention: KvRetention | None = Field(
        default=None,
        description="`pinned`: kept in the host tier (within the pinned caps); `normal`: the default; "
        "`evict`: moved to disk now and evicted first",
    )
    kv_idle_ttl_s: int | None = Field(
        default=None,
        ge=1,
        le=MAX_IDLE_TTL_S,
        description="after this many idle seconds the session's host pages move to the disk tier",
    )


class WarmRequest(_Request):
    """Which version to warm: `version`, or the head of `branch` (default: `main`)."""

    branch: str | None = Field(default=None, pattern=NAME_PATTERN)
    version: int | None = Field(default=None, ge=1, le=2**31 - 1)

    @model_validator(mode="after")
    def _one_target(self) -> WarmRequest:
        if self.branch is not None and self.version is not None:
            raise ValueError("give branch or version, not both")
        return self


class WarmOut(BaseModel):
    object: Literal["session.warm"] = "session.warm"
    session_id: SessionId
    version: int = Field(description="the version warmed; 0 when the branch has none")
    pages: int = Field(description="its stored pages")
    tokens: int = Field(description="tokens of those pages")
    resident: TierTokens = Field(description="where those tokens are now, before the warm-up")
    warming_pages: int = Field(description="pages being promoted from disk into the host tier")
    warming_tokens: int
    already_warming: int = Field(description="pages another warm-up is promoting already")


class VersionOut(BaseModel):
    object: Literal["session.version"] = "session.version"
    number: int
    parent: int | None
    branch: str
    created_at: datetime
    n_tokens: int
    resident: TierTokens = Field(description="tokens of this version whose KV is in each tier now")


class VersionDetail(VersionOut):
    messages: list[dict[str, Any]]


class RollbackRequest(_Request):
    to_version: int = Field(ge=1, le=2**31 - 1)
    branch: str = Field(default="main", pattern=NAME_PATTERN)
    expected_head: int | None = Field(default=None, ge=0, le=2**31 - 1)


class BranchCreate(_Request):
    from_version: int = Field(ge=1, le=2**31 - 1)
    name: str = Field(pattern=NAME_PATTERN)


# ------------------------------------------------------------------------------------------- erasure
class VerificationOut(BaseModel):
    checked_at: datetime
    remnants: int
    chain_ok: bool
    details: list[str]
    database_scrubbed: bool | None = Field(
        default=None,
        description="SQLite: whether the WAL was checkpointed into the (secure-delete) database file "
        "just now, so no copy of erased rows is left in it; null on PostgreSQL",
    )


class ErasureFleetOut(BaseModel):
    servers: dict[str, dict[str, Any]] = Field(
        description="per server sharing the database (the erasing one included), what it dropped of the "
        "user: pages and bytes per tier of its own (remote_keys: the shared remote tier's keys, deleted "
        "by the erasing server)"
    )
    unanswered: list[str] = Field(
        description="servers alive at the erasure that have not acknowledged it (yet): down or slow; "
        "each catches up when it is back, and verification lists it until then"
    )


class UserOut(BaseModel):
    """A user the store holds sessions or responses of; on a frontend key, its end-user id."""

    object: Literal["user"] = "user"
    id: str


class ErasureReceiptSummary(BaseModel):
    """A receipt in the admin listing: `GET /v1/erasures/{id}` adds the fleet section and a fresh
    verification."""

    id: str
    object: Literal["erasure.receipt"] = "erasure.receipt"
    erased_at: datetime
    subject: str = Field(description="salted hash of the user id, never the id itself")
    counts: dict[str, Any]


class ErasureReceiptOut(BaseModel):
    id: str
    object: Literal["erasure.receipt"] = "erasure.receipt"
    erased_at: datetime
    subject: str = Field(description="salted hash of the user id, never the id itself")
    counts: dict[str, Any]
    database_scrubbed: bool | None = Field(
        default=None,
        description="whether the WAL checkpoint right after the erasure finished (null: not SQLite, "
        "or a receipt read back later; see verification.database_scrubbed)",
    )
    fleet: ErasureFleetOut | None = Field(
        default=None,
        description="several servers on one PostgreSQL database: each server's acknowledgement of the "
        "erasure (null: a single server)",
    )
    verification: VerificationOut
    held_nothing: Literal[False] = Field(
        default=False, description="false: the server held something of the user, and this receipt erased it"
    )


class ErasureNothingHeldOut(BaseModel):
    """`DELETE /v1/users/{id}` of a user of whom the server held nothing: no receipt is written
    (receipts are permanent), and writes of the user still in flight are refused as after any
    erasure."""

    object: Literal["erasure.nothing_held"] = "erasure.nothing_held"
    held_nothing: Literal[True] = True
    checked_at: datetime


# ------------------------------------------------------------------------------------------ prefixes
class PrefixCreate(_Request):
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    text: str | None = Field(default=None, min_length=1)
    pin: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> PrefixCreate:
        if (self.messages is None) == (self.text is None):
            raise ValueError("give exactly one of messages or text")
        return self


class PrefixOut(BaseModel):
    id: str
    object: Literal["prefix"] = "prefix"
    n_tokens: int
    pinned: bool
    text: str | None
    cached_tokens: int = Field(description="tokens of the prefix whose KV is stored now")
    created_at: datetime


# -------------------------------------------------------------------------------------------- models
class ModelOut(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dss"
    max_model_len: int | None = None


class Health(BaseModel):
    status: str
    store: bool | None = None
    engine: bool | None = None
    dev_mode: bool | None = None
    # Per tier that can be unavailable without the server being unready: "ok" or "unavailable"
    # (the server then serves from the other tiers). Absent before the store is open.
    tiers: dict[str, str] | None = None
