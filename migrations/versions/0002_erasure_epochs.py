"""erasure epochs: a user's tenant changes with each erasure

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Keyed by the receipt subject hash of the user id (never the id itself). A user without a
    # row is at epoch 0, so every tenant of a 0001 database stays what it was.
    op.create_table(
        "erasure_epochs",
        sa.Column("subject", sa.String(length=64), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("subject", name="pk_erasure_epochs"),
    )


def downgrade() -> None:
    op.drop_table("erasure_epochs")
