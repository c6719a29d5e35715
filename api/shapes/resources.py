"""The wire shapes of DSS's own resources (pydantic): sessions, branches and versions, warm-ups,
users and erasure receipts, public prefixes, models and health (`api.routes`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from api.shapes.schemas import NAME_PATTERN, ChatMessage, LenientRequest, TierTokens
from dss.types import SessionId


# ------------------------------------------------------------------------------------------ sessions
class SessionCreate(LenientRequest):
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


class SessionPatch(LenientRequest):
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


class WarmRequest(LenientRequest):
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


class RollbackRequest(LenientRequest):
    to_version: int = Field(ge=1, le=2**31 - 1)
    branch: str = Field(default="main", pattern=NAME_PATTERN)
    expected_head: int | None = Field(default=None, ge=0, le=2**31 - 1)


class BranchCreate(LenientRequest):
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
class PrefixCreate(LenientRequest):
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
