"""The wire shapes of the admin API (`api.routes.admin`): keys, frontends and the audit trail."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator


class KeyCreate(BaseModel):
    """Exactly one of: `user` (a user key), `admin: true` (an admin key), `frontend` (a key of
    that frontend, registered with no trusted header if it is not yet)."""

    user: str | None = Field(default=None, max_length=256)
    admin: bool = False
    frontend: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _one_kind(self) -> KeyCreate:
        if sum((self.user is not None, self.admin, self.frontend is not None)) != 1:
            raise ValueError('give exactly one of "user", "admin": true, "frontend"')
        return self


class KeyOut(BaseModel):
    object: Literal["api_key"] = "api_key"
    id: str
    kind: Literal["user", "admin", "frontend"]
    user: str | None = Field(description="the user a user or admin key acts as; null for a frontend key")
    frontend: str | None
    created_at: datetime
    revoked_at: datetime | None


class KeyCreatedOut(KeyOut):
    key: str = Field(description="the secret: shown only in this answer, stored only as its SHA-256")


_LEAD = (
    "lead updates for this frontend's keys (docs/frontends.md, 'Volatile system prompts'): off, "
    "volatile or any; null: the server's setting"
)
_PATTERNS = "regular expressions naming this frontend's own volatile values (a user's name, a memory block)"
_DSS_HEADER = (
    "whether this frontend's keys take the end user from the X-DSS-User header (else a request "
    "sending it is a 400 end_user_source_not_trusted); off for a frontend that forwards its users' headers"
)
_BODY_USER = (
    "whether this frontend's keys take the end user from the body's `user` and `safety_identifier` "
    "(else a request sending one is a 400 end_user_source_not_trusted); off for a frontend that "
    "forwards its users' body parameters"
)


class FrontendCreate(BaseModel):
    name: str = Field(max_length=256)
    user_headers: list[str] = Field(default_factory=list, max_length=64)
    session_header: str | None = Field(default=None, max_length=256)
    lead_updates: str | None = Field(default=None, max_length=16, description=_LEAD)
    volatile_patterns: list[str] = Field(default_factory=list, max_length=64, description=_PATTERNS)
    trust_dss_user_header: bool = Field(default=True, description=_DSS_HEADER)
    trust_body_user: bool = Field(default=True, description=_BODY_USER)


class FrontendPatch(BaseModel):
    """The fields to change; a field left out stays (`session_header: null` removes it)."""

    user_headers: list[str] | None = Field(default=None, max_length=64)
    session_header: str | None = Field(default=None, max_length=256)
    lead_updates: str | None = Field(default=None, max_length=16, description=_LEAD)
    volatile_patterns: list[str] | None = Field(default=None, max_length=64, description=_PATTERNS)
    trust_dss_user_header: bool | None = Field(default=None, description=_DSS_HEADER)
    trust_body_user: bool | None = Field(default=None, description=_BODY_USER)


class FrontendOut(BaseModel):
    object: Literal["frontend"] = "frontend"
    name: str
    user_headers: list[str]
    session_header: str | None
    lead_updates: str | None = Field(description=_LEAD)
    volatile_patterns: list[str] = Field(description=_PATTERNS)
    trust_dss_user_header: bool = Field(description=_DSS_HEADER)
    trust_body_user: bool = Field(description=_BODY_USER)
    created_at: datetime
    created_by: str


class AuditEntryOut(BaseModel):
    object: Literal["audit_entry"] = "audit_entry"
    id: str
    at: datetime
    actor: str = Field(description="an admin key's id, `cli` (the `dss keys` command) or `dev`")
    action: str = Field(description="key.created, key.revoked, frontend.created or frontend.changed")
    subject: str = Field(description="a key id or a frontend name")
    detail: dict[str, Any]


class LeadGateOut(BaseModel):
    """One frontend's lead-update quality figures on this server (`dss.dialogue.lead.gate`)."""

    object: Literal["lead_gate"] = "lead_gate"
    frontend: str = Field(description="a frontend's name, or (server) for development mode and user keys")
    checks: int = Field(description="shadow checks in the rolling window")
    first_token_agreement: float | None = Field(
        description="share whose first token equals the exact prompt's"
    )
    prefix_agreement: float | None = Field(description="share whose first gate_tokens tokens all agree")
    mean_distance: float | None = Field(description="mean total variation of the first token's distributions")
    tripped: bool = Field(description="the gate turned this frontend's lead updates off")
