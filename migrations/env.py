"""Alembic environment: where the database is and what the schema should be.

The URL comes from the config's `sqlalchemy.url` or the `DSS_STORE__DB_URL` environment variable
(the server's own setting, `store.db_url`). A caller may hand over an open connection in
`config.attributes["connection"]` (in-memory SQLite).
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection, text

from dss.db.connect import make_engine
from dss.db.models import Base

config = context.config

if config.config_file_name is not None:
    # Keep the application's loggers alive when migrations run inside the server.
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata
# Arbitrary constant naming the advisory lock that serialises concurrent migrations.
_MIGRATION_LOCK_KEY = 0x44535301
# The variable the server reads its database URL from (api.settings: `DSS_` + `STORE__DB_URL`).
DB_URL_ENV = "DSS_STORE__DB_URL"


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get(DB_URL_ENV, "")
    if not url:
        raise RuntimeError(f"no database URL: set {DB_URL_ENV} (as for `dss serve`) or sqlalchemy.url")
    return url


def _configure(**kwargs: object) -> None:
    context.configure(target_metadata=target_metadata, compare_type=True, **kwargs)


def run_migrations_offline() -> None:
    url = _url()
    _configure(url=url, literal_binds=True, render_as_batch=url.startswith("sqlite"))
    with context.begin_transaction():
        context.run_migrations()


def _run_on(connection: Connection) -> None:
    _configure(connection=connection, render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Servers sharing one database may start together; one migrates, the others wait and
            # then find the schema at head. (SQLite serialises DDL by its own write lock.)
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
        context.run_migrations()


def run_migrations_online() -> None:
    given = config.attributes.get("connection")
    if given is not None:
        _run_on(given)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _run_on(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
