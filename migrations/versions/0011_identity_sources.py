"""identity sources: which of the generic ways to name an end user each frontend's keys trust

`frontends.trust_dss_user_header` (the `X-DSS-User` header) and `frontends.trust_body_user`
(the body's `user` and `safety_identifier`): a frontend that forwards its end users' extra
headers or body parameters turns them off, so that an end user cannot name someone else
(`api.end_users`). Both are true on every existing row: what those keys trusted before.

Revision ID: 0011_identity_sources
Revises: 0010_lead_updates
Create Date: 2026-12-05 03:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_identity_sources"
down_revision: str | None = "0010_lead_updates"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("frontends") as batch:
        batch.add_column(
            sa.Column("trust_dss_user_header", sa.Boolean(), nullable=False, server_default=sa.true())
        )
        batch.add_column(sa.Column("trust_body_user", sa.Boolean(), nullable=False, server_default=sa.true()))


def downgrade() -> None:
    with op.batch_alter_table("frontends") as batch:
        batch.drop_column("trust_body_user")
        batch.drop_column("trust_dss_user_header")
