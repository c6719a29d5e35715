"""versions (user_id, body_bytes): a commit's quota check reads an index, not the user's rows

Every commit counts the user's versions and sums their stored bytes (`dss.dialogue.quotas.
check_commit_quota`). Through the primary key that read visits every one of the user's version
rows, messages and tokens beside them: 8.9 ms a commit for a user holding 50,000 versions on
SQLite (the default quota allows 100,000). This index covers the query: 3.2 ms at 50,000
(`bench/dialogue_commits.py`); still linear in the user's versions.

Building it reads the whole table once; on PostgreSQL writes to `versions` wait for the build
(plain `CREATE INDEX`, within the upgrade's transaction).

Revision ID: 0015_version_bytes_index
Revises: 0014_page_drops
Create Date: 2026-12-07 11:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0015_version_bytes_index"
down_revision: str | None = "0014_page_drops"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_versions_user_bytes", "versions", ["user_id", "body_bytes"])


def downgrade() -> None:
    op.drop_index("ix_versions_user_bytes", table_name="versions")
