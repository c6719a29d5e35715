"""page drops: a session deleted on one server reaches every other server's copies

`page_drops` holds, per deletion, the tenant and the hashes of the pages the deleting server
dropped (never tokens); every other server's follower drops its own copies of them and moves its
`servers.page_drop_seq` past the row; a row every live server has passed is deleted
(`dss.fleet.page_drops`). (0012 was never used: two branches of one round were numbered apart.)

Revision ID: 0014_page_drops
Revises: 0013_erasure_subjects
Create Date: 2026-12-05 04:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014_page_drops"
down_revision: str | None = "0013_erasure_subjects"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "page_drops",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("server", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("hashes", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("seq", name="pk_page_drops"),
    )
    with op.batch_alter_table("servers") as batch:
        batch.add_column(sa.Column("page_drop_seq", sa.Integer(), server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("servers") as batch:
        batch.drop_column("page_drop_seq")
    op.drop_table("page_drops")
