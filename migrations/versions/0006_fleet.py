"""several servers on one database: page rows per server, fleet membership, erasure acknowledgements

`pages` gets a `server` column (the id of the server whose disk tier holds the page) and its
primary key becomes (server, hash): two servers sharing one database hold their own files, and
one server's start-up recovery must only reconcile its own rows. Existing rows get server '';
the first store to open adopts them as its own (a store upgraded from one server). SQLite
rebuilds the table (`batch_alter_table`); no foreign key references `pages`, so no cascade runs.

Two new tables: `servers` (registration and heartbeat of each server, and the highest erasure
receipt seq it has applied) and `erasure_acks` (each server's acknowledgement of a receipt: what
it dropped, what its local scan still found). See `dss.fleet`.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts(name: str, nullable: bool = False) -> sa.Column:
    if nullable:
        return sa.Column(name, sa.DateTime(timezone=True), nullable=True)
    return sa.Column(name, sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False)


def upgrade() -> None:
    with op.batch_alter_table("pages") as batch:
        batch.add_column(sa.Column("server", sa.String(length=64), server_default="", nullable=False))
        batch.drop_constraint("pk_pages", type_="primary")
        batch.create_primary_key("pk_pages", ["server", "hash"])
    op.create_table(
        "servers",
        sa.Column("id", sa.String(length=64), nullable=False),
        _ts("started_at"),
        _ts("last_seen"),
        sa.Column("erasure_seq", sa.Integer(), server_default="0", nullable=False),
        sa.Column("host", sa.String(length=256), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_servers"),
    )
    op.create_table(
        "erasure_acks",
        sa.Column("receipt_id", sa.String(length=64), nullable=False),
        sa.Column("server", sa.String(length=64), nullable=False),
        _ts("acked_at", nullable=True),
        sa.Column("counts", sa.JSON(), nullable=True),
        sa.Column("remnants", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("receipt_id", "server", name="pk_erasure_acks"),
    )


def downgrade() -> None:
    op.drop_table("erasure_acks")
    op.drop_table("servers")
    # Two servers' rows of one page would collide under the old key: keep one of them.
    op.execute(
        "DELETE FROM pages WHERE server <> (SELECT min(p2.server) FROM pages p2 WHERE p2.hash = pages.hash)"
    )
    with op.batch_alter_table("pages") as batch:
        batch.drop_constraint("pk_pages", type_="primary")
        batch.create_primary_key("pk_pages", ["hash"])
        batch.drop_column("server")
