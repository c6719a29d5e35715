"""erasure subjects: the owner's subject hash on sessions and stored responses, and the erased
user's on each receipt

`sessions.subject` and `responses.subject` (indexed) hold `Identity.subject_hash` of the row's
owner; `erasure_receipts.user_subject` that of the erased user (outside the hashed entry). An
erasure's verification then finds the user's remaining rows by one indexed lookup instead of
hashing every user id of the store (`dss.ops.erasure.verify`). Existing rows keep NULL: the
server secret that derives the hash is not the migration's; `verify` checks those rows the old
way, over their owners only.

Revision ID: 0013_erasure_subjects
Revises: 0011_identity_sources
Create Date: 2026-12-12 03:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_erasure_subjects"
down_revision: str | None = "0011_identity_sources"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table in ("sessions", "responses"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("subject", sa.String(64), nullable=True))
        op.create_index(f"ix_{table}_subject", table, ["subject"])
    with op.batch_alter_table("erasure_receipts") as batch:
        batch.add_column(sa.Column("user_subject", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("erasure_receipts") as batch:
        batch.drop_column("user_subject")
    for table in ("responses", "sessions"):
        op.drop_index(f"ix_{table}_subject", table_name=table)
        with op.batch_alter_table(table) as batch:
            batch.drop_column("subject")
