"""The metadata database: table models, engines, transactions and migrations.

Import rules: depends only on SQLAlchemy/Alembic and `dss.types`/`dss.errors`; services such as
`dss.dialogue.versions` build on it, never the other way round.
"""

from dss.db.connect import (
    current_revision,
    make_engine,
    make_session_factory,
    sqlite_url_for,
    transaction,
    upgrade_to_head,
)

__all__ = [
    "current_revision",
    "make_engine",
    "make_session_factory",
    "sqlite_url_for",
    "transaction",
    "upgrade_to_head",
]
