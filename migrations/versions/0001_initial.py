"""initial schema: store meta, data keys, sessions, branches, versions, pages, prefixes, receipts, api keys

Revision ID: 0001
Revises:
Create Date: 2025-01-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts(name: str, nullable: bool = False) -> sa.Column:
    if nullable:
        return sa.Column(name, sa.DateTime(timezone=True), nullable=True)
    return sa.Column(name, sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False)


def upgrade() -> None:
    op.create_table(
        "store_meta",
        sa.Column("key", sa.String(length=128), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_store_meta"),
    )
    op.create_table(
        "data_keys",
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("wrapped", sa.LargeBinary(), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("tenant", name="pk_data_keys"),
    )
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.String(length=256), nullable=False),
        _ts("created_at"),
        _ts("updated_at"),
        sa.Column("system_prompt", sa.Text(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("version_count", sa.Integer(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_sessions"),
    )
    op.create_index("ix_sessions_user_id", "sessions", ["user_id"], unique=False)
    op.create_table(
        "branches",
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("head_version", sa.Integer(), server_default="0", nullable=False),
        _ts("created_at"),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name="fk_branches_session_id_sessions", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("session_id", "name", name="pk_branches"),
    )
    op.create_table(
        "versions",
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("parent", sa.Integer(), nullable=True),
        sa.Column("branch", sa.String(length=128), nullable=False),
        _ts("created_at"),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.LargeBinary(), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name="fk_versions_session_id_sessions", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("session_id", "number", name="pk_versions"),
    )
    op.create_table(
        "pages",
        sa.Column("hash", sa.LargeBinary(length=32), nullable=False),
        sa.Column("namespace", sa.LargeBinary(length=16), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("parent", sa.LargeBinary(length=32), nullable=False),
        sa.Column("page_index", sa.Integer(), nullable=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.LargeBinary(), nullable=False),
        sa.Column("nbytes", sa.Integer(), nullable=False),
        sa.Column("disk_bytes", sa.Integer(), nullable=False),
        sa.Column("codec", sa.String(length=32), nullable=False),
        sa.Column("checksum", sa.LargeBinary(length=16), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("hash", name="pk_pages"),
    )
    op.create_index("ix_pages_namespace", "pages", ["namespace"], unique=False)
    op.create_index("ix_pages_tenant", "pages", ["tenant"], unique=False)
    op.create_table(
        "public_prefixes",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.LargeBinary(), nullable=False),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("messages", sa.JSON(), nullable=True),
        sa.Column("pinned", sa.Boolean(), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name="pk_public_prefixes"),
    )
    op.create_table(
        "erasure_receipts",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        _ts("erased_at"),
        sa.Column("subject", sa.String(length=128), nullable=False),
        sa.Column("counts", sa.JSON(), nullable=False),
        sa.Column("prev_hash", sa.String(length=64), nullable=False),
        sa.Column("entry_hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_erasure_receipts"),
        sa.UniqueConstraint("seq", name="uq_erasure_receipts_seq"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("key_hash", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.String(length=256), nullable=True),
        sa.Column("is_admin", sa.Boolean(), nullable=False),
        _ts("created_at"),
        _ts("revoked_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
    )


def downgrade() -> None:
    op.drop_table("api_keys")
    op.drop_table("erasure_receipts")
    op.drop_table("public_prefixes")
    op.drop_index("ix_pages_tenant", table_name="pages")
    op.drop_index("ix_pages_namespace", table_name="pages")
    op.drop_table("pages")
    op.drop_table("versions")
    op.drop_table("branches")
    op.drop_index("ix_sessions_user_id", table_name="sessions")
    op.drop_table("sessions")
    op.drop_table("data_keys")
    op.drop_table("store_meta")
