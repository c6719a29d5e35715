"""a KV retention hint and an idle TTL per session

`sessions.kv_retention` (`pinned`, `normal` or `evict`; existing rows get `normal`) and
`sessions.kv_idle_ttl_s` (seconds of idleness after which the session's host pages move to the
disk tier; NULL: never). Both are plain added columns: no table is rebuilt, so SQLite's foreign-key
actions on branches and versions never run. And an index on `sessions.updated_at`, which the
retention sweeper filters and orders on (`VersionStore.retention_hints`).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 15:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "sessions",
        sa.Column("kv_retention", sa.String(length=16), server_default="normal", nullable=False),
    )
    op.add_column("sessions", sa.Column("kv_idle_ttl_s", sa.Integer(), nullable=True))
    op.create_index("ix_sessions_updated_at", "sessions", ["updated_at"])


def downgrade() -> None:
    op.drop_index("ix_sessions_updated_at", table_name="sessions")
    # ALTER TABLE ... DROP COLUMN (SQLite 3.35+): no table rebuild, no cascade.
    op.drop_column("sessions", "kv_idle_ttl_s")
    op.drop_column("sessions", "kv_retention")
