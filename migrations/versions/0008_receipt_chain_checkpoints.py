"""receipt chain checkpoints: verifications start at the last sealed checkpoint

`chain_checkpoints` holds points of the erasure receipt chain that a verification found intact from
the start (seq, the receipt's entry hash, an HMAC seal under the server secret), so that a later
verification checks only the receipts since the checkpoint before it (`dss.ops.erasure.chain`).
Empty at first: the first verification walks the chain once and writes them.

Revision ID: 0008
Revises: 0007_sealed_tokens
Create Date: 2026-12-02 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007_sealed_tokens"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "chain_checkpoints",
        sa.Column("seq", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("entry_hash", sa.String(length=64), nullable=False),
        sa.Column("seal", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("seq", name="pk_chain_checkpoints"),
    )


def downgrade() -> None:
    op.drop_table("chain_checkpoints")
