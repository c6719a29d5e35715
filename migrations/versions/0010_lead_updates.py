"""lead updates: what the model saw of a version, and each frontend's lead-update setting

`versions.seen` records what the model saw where it differs from the client's messages (a turn
served as a lead update: `dss.dialogue.lead.view`); null, as on every older row, means exactly
the messages. `versions.lead` keeps a version's first message when only it differs from the
parent's, so that the rest is still stored as a delta (`dss.dialogue.history`). `frontends.lead_updates` (off, volatile, any; null: the server's setting) and
`frontends.volatile_patterns` (the operator's own volatile values) configure lead updates for a
frontend's keys. Nothing existing changes meaning.

Revision ID: 0010_lead_updates
Revises: 0009_frontends
Create Date: 2026-12-05 01:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_lead_updates"
down_revision: str | None = "0009_frontends"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("versions") as batch:
        batch.add_column(sa.Column("seen", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("lead", sa.JSON(), nullable=True))
    with op.batch_alter_table("frontends") as batch:
        batch.add_column(sa.Column("lead_updates", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("volatile_patterns", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("frontends") as batch:
        batch.drop_column("volatile_patterns")
        batch.drop_column("lead_updates")
    with op.batch_alter_table("versions") as batch:
        batch.drop_column("lead")
        batch.drop_column("seen")
