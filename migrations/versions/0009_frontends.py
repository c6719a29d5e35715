"""frontends: keys that act for a frontend's end users, and an audit trail of key changes

`frontends` registers a chat frontend (Open WebUI, LibreChat, a company's own) by name, with the
request headers its keys trust to name the end user and the session; `api_keys.frontend` marks a
key of such a frontend (no `user_id`: it acts for the end user each request names, as the DSS
user `<frontend>/<end user>`). `admin_audit` records who created and revoked keys and created
and changed frontends (`api.keys.audit`). Nothing existing changes meaning: every older key has
no frontend.

Revision ID: 0009_frontends
Revises: 0008
Create Date: 2026-12-09 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_frontends"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "frontends",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("user_headers", sa.JSON(), nullable=False),
        sa.Column("session_header", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("created_by", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_frontends"),
    )
    op.create_table(
        "admin_audit",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("subject", sa.String(length=128), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_admin_audit"),
    )
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("frontend", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("frontend")
    op.drop_table("admin_audit")
    op.drop_table("frontends")
