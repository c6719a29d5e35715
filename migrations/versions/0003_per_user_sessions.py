"""per-user session ids, and messages stored once across a session's versions

Sessions were keyed by their id alone, so one user's "trip" made every other user's "trip" a
404 (and told them it existed). Sessions, branches and versions are now keyed by
(user_id, session_id, ...). Versions keep only the messages they add to their parent's, with a
chained digest of the whole list for prefix lookups (see `dss.dialogue.history`).

The three tables are rebuilt: the old ones are renamed aside, the new ones created under the
final names, rows copied (versions re-encoded in Python), and the old ones dropped. Renaming
first (rather than dropping sessions while children reference it) keeps SQLite's foreign-key
actions from deleting anything; on PostgreSQL the old primary-key indexes are renamed too,
because index names are unique per schema.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 12:00:00
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD = "_0002"
_BATCH = 500


def _ts(name: str) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False)


def _session_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["user_id", "session_id"],
        ["sessions.user_id", "sessions.id"],
        name=f"fk_{table}_user_id_sessions",
        ondelete="CASCADE",
    )


# A frozen copy of `dss.dialogue.history` as of this revision: a migration must not change
# meaning when the application code moves on.
_SEED = hashlib.sha256(b"dss messages v1").digest()


def _prefix_digests(messages: list[dict[str, Any]]) -> list[str]:
    state = _SEED
    out = [state.hex()]
    for m in messages:
        body = json.dumps(m, sort_keys=True, ensure_ascii=True, separators=(",", ":")).encode()
        state = hashlib.sha256(state + body).digest()
        out.append(state.hex())
    return out


def _create_new_tables() -> None:
    op.create_table(
        "sessions",
        sa.Column("user_id", sa.String(length=256), nullable=False),
        sa.Column("id", sa.String(length=128), nullable=False),
        _ts("created_at"),
        _ts("updated_at"),
        sa.Column("system_prompt", sa.Text(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("version_count", sa.Integer(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("user_id", "id", name="pk_sessions"),
    )
    op.create_table(
        "branches",
        sa.Column("user_id", sa.String(length=256), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("head_version", sa.Integer(), server_default="0", nullable=False),
        _ts("created_at"),
        _session_fk("branches"),
        sa.PrimaryKeyConstraint("user_id", "session_id", "name", name="pk_branches"),
    )
    op.create_table(
        "versions",
        sa.Column("user_id", sa.String(length=256), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("parent", sa.Integer(), nullable=True),
        sa.Column("branch", sa.String(length=128), nullable=False),
        _ts("created_at"),
        sa.Column("n_tokens", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.LargeBinary(), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("messages_base", sa.Integer(), nullable=False),
        sa.Column("n_messages", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("body_bytes", sa.Integer(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=True),
        _session_fk("versions"),
        sa.PrimaryKeyConstraint("user_id", "session_id", "number", name="pk_versions"),
    )
    op.create_index("ix_versions_digest", "versions", ["user_id", "session_id", "digest"], unique=False)


def _copy_rows() -> None:
    bind = op.get_bind()
    meta = sa.MetaData()
    old_sessions = sa.Table("sessions" + _OLD, meta, autoload_with=bind)
    old_branches = sa.Table("branches" + _OLD, meta, autoload_with=bind)
    old_versions = sa.Table(
        "versions" + _OLD, meta, sa.Column("messages", sa.JSON()), autoload_with=bind, extend_existing=True
    )
    new_meta = sa.MetaData()
    sessions = sa.Table("sessions", new_meta, autoload_with=bind)
    branches = sa.Table("branches", new_meta, autoload_with=bind)
    versions = sa.Table("versions", new_meta, sa.Column("messages", sa.JSON()), autoload_with=bind)

    owner: dict[str, str] = {}
    rows = [dict(r._mapping) for r in bind.execute(sa.select(old_sessions))]
    for r in rows:
        owner[r["id"]] = r["user_id"]
    if rows:
        bind.execute(sessions.insert(), rows)
    brows = [{**dict(r._mapping), "user_id": owner[r.session_id]} for r in bind.execute(sa.select(old_branches))]
    if brows:
        bind.execute(branches.insert(), brows)

    for sid, user in owner.items():
        full: dict[int, tuple[int, str]] = {}  # number -> (n_messages, digest)
        out: list[dict[str, Any]] = []
        q = sa.select(old_versions).where(old_versions.c.session_id == sid).order_by(old_versions.c.number)
        for r in bind.execute(q):
            v = dict(r._mapping)
            msgs = list(v["messages"])
            digests = _prefix_digests(msgs)
            base = 0
            parent = full.get(v["parent"]) if v["parent"] is not None else None
            if parent is not None and 0 < parent[0] <= len(msgs) and digests[parent[0]] == parent[1]:
                base = parent[0]
            full[v["number"]] = (len(msgs), digests[-1])
            delta = msgs[base:]
            delta_bytes = len(json.dumps(delta, ensure_ascii=False, separators=(",", ":")).encode())
            v.update(
                user_id=user,
                messages=delta,
                messages_base=base,
                n_messages=len(msgs),
                digest=digests[-1],
                body_bytes=len(v["tokens"]) + delta_bytes,
            )
            out.append(v)
            if len(out) >= _BATCH:
                bind.execute(versions.insert(), out)
                out = []
        if out:
            bind.execute(versions.insert(), out)


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    op.drop_index("ix_sessions_user_id", table_name="sessions")
    for table in ("versions", "branches", "sessions"):
        op.rename_table(table, table + _OLD)
        if postgres:
            op.execute(f"ALTER INDEX pk_{table} RENAME TO pk_{table}{_OLD}")
    _create_new_tables()
    _copy_rows()
    for table in ("versions", "branches", "sessions"):
        op.drop_table(table + _OLD)


def downgrade() -> None:
    raise NotImplementedError("0003 is not reversible: session ids are no longer globally unique")
