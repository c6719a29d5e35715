"""page token ids sealed under the tenant's data key, never in the clear

`pages.tokens` held each page's token ids in plain form: user content (a sessionless chat's
prompt) in every database backup. It becomes `pages.sealed_tokens`: AES-GCM under the tenant's
data key (`dss.pages.rows`). A migration cannot seal (it has no master key), so existing rows
are deleted, and their plain token ids with them: the pages are a cache, and the next start's
recovery removes their files as orphans (each server of a fleet at its own next start). The
cost is one cold disk tier, never data. SQLite rewrites the table (`batch_alter_table`) and
runs with `secure_delete`, so the old values do not stay in free pages of the file.

Revision ID: 0007_sealed_tokens
Revises: 0006
Create Date: 2026-12-02 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_sealed_tokens"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("DELETE FROM pages")
    with op.batch_alter_table("pages") as batch:
        batch.drop_column("tokens")
        batch.add_column(sa.Column("sealed_tokens", sa.LargeBinary(), nullable=False))


def downgrade() -> None:
    op.execute("DELETE FROM pages")
    with op.batch_alter_table("pages") as batch:
        batch.drop_column("sealed_tokens")
        batch.add_column(sa.Column("tokens", sa.LargeBinary(), nullable=False))
