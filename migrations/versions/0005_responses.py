"""stored OpenAI Responses API responses, each holding the version it committed

A new table `responses` (see `dss.dialogue.response_store`): a response's id, its owner and session,
the version it committed, the response it continues (`previous_response_id`), and what the API
returns for it (model, status, instructions, input items, output items, usage, parameters). Rows
go with their session and with their version (both foreign keys cascade; the store also deletes
them explicitly, which stays correct where foreign-key actions are off). Indexed by
(user_id, session_id, version), which finds the responses of a version subtree, and by
`previous_response_id`, which finds a response's continuations. A new table only: no existing
table is rebuilt, so SQLite's foreign-key actions on other tables never run.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.String(length=256), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("previous_response_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("instructions", sa.Text(), nullable=True),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("output", sa.JSON(), nullable=False),
        sa.Column("usage", sa.JSON(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(
            ["user_id", "session_id"],
            ["sessions.user_id", "sessions.id"],
            name="fk_responses_user_id_sessions",
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["user_id", "session_id", "version"],
            ["versions.user_id", "versions.session_id", "versions.number"],
            name="fk_responses_user_id_versions",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_responses"),
    )
    op.create_index("ix_responses_version", "responses", ["user_id", "session_id", "version"])
    op.create_index("ix_responses_previous_response_id", "responses", ["previous_response_id"])


def downgrade() -> None:
    op.drop_index("ix_responses_previous_response_id", table_name="responses")
    op.drop_index("ix_responses_version", table_name="responses")
    op.drop_table("responses")
