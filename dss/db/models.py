"""SQLAlchemy table models of the store's durable metadata.

These are storage models only; API request/response schemas live in `api/` and are mapped from
the frozen dataclasses the services return. The schema itself is created by the Alembic
migrations in `migrations/`; `Base.metadata` exists so that autogenerate can compare against it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    func,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Explicit constraint names keep SQLite (batch mode) and PostgreSQL migrations identical.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

HASH_LEN = 32
NAMESPACE_LEN = 16
CHECKSUM_LEN = 16
ID_LEN = 128
FRONTEND_NAME_LEN = 64
HEADER_NAME_LEN = 128


def aware(ts: datetime) -> datetime:
    """A timestamp read back from a row, in UTC: SQLite hands back naive datetimes (every
    timestamp is stored in UTC), and a naive one would leave the API's `date-time` without its
    offset."""
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def utcnow() -> datetime:
    """Client-side timestamp default: microsecond resolution on every backend.

    `server_default=func.now()` still covers rows written outside the ORM; SQLite's
    CURRENT_TIMESTAMP only has whole seconds, which would make creation order ambiguous.
    """
    return datetime.now(UTC)


def _timestamp(nullable: bool = False) -> Mapped[Any]:
    if nullable:
        return mapped_column(DateTime(timezone=True), nullable=True)
    return mapped_column(DateTime(timezone=True), nullable=False, default=utcnow, server_default=func.now())


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class StoreMeta(Base):
    """Small store-wide settings: master-key verifier, tenant-salt secret, format version."""

    __tablename__ = "store_meta"

    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    value: Mapped[str] = mapped_column(Text, nullable=False)


class DataKey(Base):
    """A tenant's data key, wrapped by the master key. Deleting the row is crypto-erasure."""

    __tablename__ = "data_keys"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    wrapped: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    created_at: Mapped[datetime] = _timestamp()


class ErasureEpoch(Base):
    """How many times a user was erased; part of the user's tenant (see `dss.keys.identity`).
    Keyed by the user's receipt subject hash, never the user id."""

    __tablename__ = "erasure_epochs"

    subject: Mapped[str] = mapped_column(String(64), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, nullable=False)


class SessionRow(Base):
    """A session, keyed by its owner and its id: session ids are chosen per user, so two users
    can both have a session "trip" and neither can learn that the other's exists."""

    __tablename__ = "sessions"

    user_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    created_at: Mapped[datetime] = _timestamp()
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True),
        nullable=False,
        default=utcnow,
        onupdate=utcnow,
        server_default=func.now(),
        index=True,  # the retention sweeper reads sessions by it (migration 0004)
    )
    system_prompt: Mapped[str | None] = mapped_column(Text, nullable=True)
    # `metadata` is reserved on declarative classes, hence the attribute name.
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON(none_as_null=True), nullable=True)
    # Highest version number allocated so far; bumped with a compare-and-set on every commit.
    version_count: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    # The KV retention hint (`pinned`, `normal`, `evict`) and the idle TTL after which the
    # session's host pages move to disk (None: never); see `dss.ops.retention` (migration 0004).
    kv_retention: Mapped[str] = mapped_column(
        String(16), nullable=False, default="normal", server_default="normal"
    )
    kv_idle_ttl_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The owner's subject hash (`Identity.subject_hash`): what an erasure's verification finds
    # the erased user's rows by, without hashing every user id (migration 0013). None: written
    # before that migration, or by a version store without an identity.
    subject: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)


def _session_fk() -> ForeignKeyConstraint:
    return ForeignKeyConstraint(
        ["user_id", "session_id"], ["sessions.user_id", "sessions.id"], ondelete="CASCADE"
    )


class BranchRow(Base):
    __tablename__ = "branches"
    __table_args__ = (_session_fk(),)

    user_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    name: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    # 0 means the branch has no versions yet (version numbers start at 1).
    head_version: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    created_at: Mapped[datetime] = _timestamp()


class VersionRow(Base):
    """One version. Its messages are stored once across the tree: `messages` holds only what this
    version adds after the first `messages_base` messages of its parent (0: the whole list), and
    `digest` chains over the whole list, so the deepest version a request extends is found by
    an indexed lookup of the request's prefix digests (see `dss.dialogue.history`)."""

    __tablename__ = "versions"
    __table_args__ = (
        _session_fk(),
        Index("ix_versions_digest", "user_id", "session_id", "digest"),
        # Covers a commit's quota check (the user's version count and stored bytes): migration 0015.
        Index("ix_versions_user_bytes", "user_id", "body_bytes"),
    )

    user_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    number: Mapped[int] = mapped_column(Integer, primary_key=True)
    parent: Mapped[int | None] = mapped_column(Integer, nullable=True)
    branch: Mapped[str] = mapped_column(String(ID_LEN), nullable=False)
    created_at: Mapped[datetime] = _timestamp()
    n_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    tokens: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)  # int32 little-endian
    messages: Mapped[list[dict[str, Any]]] = mapped_column(JSON, nullable=False)
    messages_base: Mapped[int] = mapped_column(Integer, nullable=False)
    n_messages: Mapped[int] = mapped_column(Integer, nullable=False)
    digest: Mapped[str] = mapped_column(String(64), nullable=False)
    # Bytes this row stores (tokens + its messages' JSON): what the stored-bytes quota counts.
    body_bytes: Mapped[int] = mapped_column(Integer, nullable=False)
    fingerprint: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # What the model saw where it differs from `messages` (a lead update was served): a
    # `dss.dialogue.lead.view.ModelView` record; None: exactly `messages`.
    seen: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # The first message (a system prompt that changed) in place of the parent's, the rest being a
    # delta on the parent's as usual (`dss.dialogue.history`); None: inherited or in `messages`.
    lead: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class ResponseRow(Base):
    """A stored OpenAI Responses API response: the version it committed and what the API returns
    for it (`dss.dialogue.response_store`). Keyed by its globally unique id (`resp_` + 48 random hex
    digits); every lookup also names the owner, so another user's id reads as missing."""

    __tablename__ = "responses"
    __table_args__ = (
        _session_fk(),
        ForeignKeyConstraint(
            ["user_id", "session_id", "version"],
            ["versions.user_id", "versions.session_id", "versions.number"],
            ondelete="CASCADE",
        ),
        Index("ix_responses_version", "user_id", "session_id", "version"),
        Index("ix_responses_previous_response_id", "previous_response_id"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[str] = mapped_column(String(256), nullable=False)
    session_id: Mapped[str] = mapped_column(String(ID_LEN), nullable=False)
    version: Mapped[int] = mapped_column(Integer, nullable=False)
    previous_response_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = _timestamp()
    model: Mapped[str] = mapped_column(String(256), nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    instructions: Mapped[str | None] = mapped_column(Text, nullable=True)
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(JSON, nullable=False)
    output: Mapped[list[dict[str, Any]]] = mapped_column(JSON, nullable=False)
    usage: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    params: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    subject: Mapped[str | None] = mapped_column(
        String(64), nullable=True, index=True
    )  # as `SessionRow.subject`


SERVER_ID_LEN = 64


class PageRow(Base):
    """One page that has reached a server's disk tier; that server's page index is rebuilt from
    its rows. Keyed by (server, hash): several servers sharing one database each hold their own
    files, and one server's recovery must never take another's rows for rows without a file
    (migration 0006; rows written before it have server '', adopted by the first store to open)."""

    __tablename__ = "pages"

    server: Mapped[str] = mapped_column(String(SERVER_ID_LEN), primary_key=True, server_default="")
    hash: Mapped[bytes] = mapped_column(LargeBinary(HASH_LEN), primary_key=True)
    namespace: Mapped[bytes] = mapped_column(LargeBinary(NAMESPACE_LEN), nullable=False, index=True)
    tenant: Mapped[str] = mapped_column(String(64), nullable=False, index=True)
    fingerprint: Mapped[str] = mapped_column(String(64), nullable=False)
    parent: Mapped[bytes] = mapped_column(LargeBinary(HASH_LEN), nullable=False)
    page_index: Mapped[int] = mapped_column(Integer, nullable=False)
    n_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    # The page's token ids (int32 LE), AES-GCM under the tenant's data key (`dss.pages.rows`):
    # user content, never in the clear here (migration 0007).
    sealed_tokens: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    nbytes: Mapped[int] = mapped_column(Integer, nullable=False)
    disk_bytes: Mapped[int] = mapped_column(Integer, nullable=False)
    codec: Mapped[str] = mapped_column(String(32), nullable=False)
    checksum: Mapped[bytes] = mapped_column(LargeBinary(CHECKSUM_LEN), nullable=False)
    created_at: Mapped[datetime] = _timestamp()


class PublicPrefixRow(Base):
    __tablename__ = "public_prefixes"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64), nullable=False)
    n_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    tokens: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)
    text: Mapped[str | None] = mapped_column(Text, nullable=True)
    messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    pinned: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    created_at: Mapped[datetime] = _timestamp()


class ErasureReceiptRow(Base):
    """Append-only and hash-chained: `entry_hash` covers this row and `prev_hash`."""

    __tablename__ = "erasure_receipts"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, nullable=False, unique=True)
    erased_at: Mapped[datetime] = _timestamp()
    subject: Mapped[str] = mapped_column(String(128), nullable=False)
    counts: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    prev_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    entry_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    # The erased user's subject hash, so that `verify` finds the user's rows by their `subject`
    # (migration 0013; None in older receipts). Not part of the hashed entry.
    user_subject: Mapped[str | None] = mapped_column(String(64), nullable=True)


class ChainCheckpointRow(Base):
    """A point of the receipt chain verified intact from its start: receipt `seq` had `entry_hash`
    then. `seal` is an HMAC of both under the server secret (`dss.ops.erasure.chain`), so a
    verification may start here, and whoever holds only the database cannot add one."""

    __tablename__ = "chain_checkpoints"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    entry_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    seal: Mapped[str] = mapped_column(String(64), nullable=False)
    created_at: Mapped[datetime] = _timestamp()


class ApiKeyRow(Base):
    """An API key (its SHA-256 only): a user key (`user_id`), an admin key (`is_admin`), or a
    frontend key (`frontend`, no `user_id`), which acts for the frontend's end users."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(128), nullable=False, unique=True)
    user_id: Mapped[str | None] = mapped_column(String(256), nullable=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    created_at: Mapped[datetime] = _timestamp()
    revoked_at: Mapped[datetime | None] = _timestamp(nullable=True)
    frontend: Mapped[str | None] = mapped_column(String(FRONTEND_NAME_LEN), nullable=True)


class FrontendRow(Base):
    """A registered frontend (`api.keys.frontends`): the request headers its keys trust to name
    the end user (`user_headers`, a JSON list of names) and, optionally, the session."""

    __tablename__ = "frontends"

    name: Mapped[str] = mapped_column(String(FRONTEND_NAME_LEN), primary_key=True)
    user_headers: Mapped[list[str]] = mapped_column(JSON, nullable=False)
    session_header: Mapped[str | None] = mapped_column(String(HEADER_NAME_LEN), nullable=True)
    created_at: Mapped[datetime] = _timestamp()
    created_by: Mapped[str] = mapped_column(String(64), nullable=False)
    # Lead updates for its keys' turns (`dss.dialogue.lead.policy`): off, volatile or any; None:
    # the server's setting. `volatile_patterns`: the operator's own volatile values (regexes).
    lead_updates: Mapped[str | None] = mapped_column(String(16), nullable=True)
    volatile_patterns: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    # Whether its keys take the end user from `X-DSS-User`, and from the body's `user` and
    # `safety_identifier` (`api.end_users`): off for a frontend that forwards what its end users send.
    trust_dss_user_header: Mapped[bool] = mapped_column(
        Boolean, nullable=False, default=True, server_default=true()
    )
    trust_body_user: Mapped[bool] = mapped_column(
        Boolean, nullable=False, default=True, server_default=true()
    )


class AdminAuditRow(Base):
    """Append-only: who (a key id, or `cli`) did what to keys and frontends, and when. An erasure
    replaces its user's id in `detail` by a pseudonym (`api.keys.store_tables`)."""

    __tablename__ = "admin_audit"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = _timestamp()
    actor: Mapped[str] = mapped_column(String(64), nullable=False)
    action: Mapped[str] = mapped_column(String(32), nullable=False)
    subject: Mapped[str] = mapped_column(String(128), nullable=False)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)


class ServerRow(Base):
    """A server of the fleet sharing this database (`dss.fleet.members`): registered at open,
    `last_seen` refreshed by its heartbeat; `erasure_seq` is the highest erasure receipt seq up
    to which it has applied every receipt (its catch-up starts after it)."""

    __tablename__ = "servers"

    id: Mapped[str] = mapped_column(String(SERVER_ID_LEN), primary_key=True)
    started_at: Mapped[datetime] = _timestamp()
    last_seen: Mapped[datetime] = _timestamp()
    erasure_seq: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    # The highest `page_drops.seq` up to which it has applied the fleet's page drops (migration 0014).
    page_drop_seq: Mapped[int] = mapped_column(Integer, nullable=False, default=0, server_default="0")
    host: Mapped[str | None] = mapped_column(String(256), nullable=True)  # a note for operators


class PageDropRow(Base):
    """Pages one server deleted with a session (`dss.fleet.page_drops`): every other server of the
    fleet drops its own copies of them. Deleted once every live server has applied it (its
    `servers.page_drop_seq` is past it); the rows hold a tenant and page hashes, never tokens."""

    __tablename__ = "page_drops"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    server: Mapped[str] = mapped_column(String(SERVER_ID_LEN), nullable=False)
    tenant: Mapped[str] = mapped_column(String(64), nullable=False)
    hashes: Mapped[bytes] = mapped_column(LargeBinary, nullable=False)  # HASH_LEN bytes each
    created_at: Mapped[datetime] = _timestamp()


class ErasureAckRow(Base):
    """One server's acknowledgement of an erasure receipt (`dss.fleet.erasures`). The erasing
    server writes a pending row (`acked_at` NULL) for every server alive at the erasure and its
    own, acknowledged one; each other server fills in its own when it has dropped its copies:
    what it dropped per tier (`counts`) and what its local scan still found (`remnants`)."""

    __tablename__ = "erasure_acks"

    receipt_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    server: Mapped[str] = mapped_column(String(SERVER_ID_LEN), primary_key=True)
    acked_at: Mapped[datetime | None] = _timestamp(nullable=True)
    counts: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    remnants: Mapped[int | None] = mapped_column(Integer, nullable=True)


# The one owner of each table: the module or package whose code alone reads and writes it (a
# part of `dss` counts as one owner: its modules share its tables). Everyone else asks the owner,
# through a method that takes the caller's transaction where the work must stay in one (an
# erasure). Tables two parts both need are owned below both (`dss.db.store_meta`,
# `dss.db.receipt_rows`); the API's own tables by `api`, which the store reaches only through what
# the API passes in (`dss.store.ApiTables`). `tests/test_layering.py`
# (`test_only_a_tables_owner_reaches_it`) checks that no other module names a model class, or the
# table in raw SQL.
TABLE_OWNERS: dict[str, str] = {
    "store_meta": "dss.db.store_meta",
    "data_keys": "dss.keys",
    "erasure_epochs": "dss.keys",
    "sessions": "dss.dialogue",
    "branches": "dss.dialogue",
    "versions": "dss.dialogue",
    "responses": "dss.dialogue",
    "pages": "dss.pages",
    "public_prefixes": "dss.ops.kv.public_prefixes",
    "erasure_receipts": "dss.db.receipt_rows",
    "chain_checkpoints": "dss.ops.erasure.chain",
    "api_keys": "api",
    "frontends": "api",
    "admin_audit": "api",
    "servers": "dss.fleet",
    "page_drops": "dss.fleet",
    "erasure_acks": "dss.fleet",
}
