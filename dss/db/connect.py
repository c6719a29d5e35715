"""Engines, sessions, transactions and migrations for the metadata database.

Works with SQLite (one server, the default) and PostgreSQL through psycopg 3. The schema is only
ever created by the Alembic migrations in the repository's `migrations/` folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import QueuePool, StaticPool

from dss.db.write_gate import GatedConnection, WriteGate, gate_for

REPO_ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS_DIR = REPO_ROOT / "migrations"
SQLITE_FILENAME = "dss.sqlite3"
_MIGRATE_LOCK = threading.Lock()

BUSY_TIMEOUT_MS = 5000
_SQLITE_PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA foreign_keys=ON",
    f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}",
    # FULL: a version whose number a client holds survives a power loss (NORMAL may roll back
    # the last commits). Measured by bench/dialogue_commits.py: about 1.07x the commit time.
    "PRAGMA synchronous=FULL",
    # erased rows must not linger in free pages of the database file
    "PRAGMA secure_delete=ON",
)


def sqlite_url_for(data_dir: Path) -> str:
    return f"sqlite:///{Path(data_dir).resolve() / SQLITE_FILENAME}"


def private_sqlite_file(database: Path) -> Path:
    """Create a SQLite database file readable by its owner only (0600, in a 0700 folder when the
    folder is new) before SQLite does it under the process umask; its WAL and shared-memory files
    take the database file's mode. The database holds every message in plain text."""
    path = database.expanduser().resolve()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return path


def _is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def is_sqlite_file(url: str) -> bool:
    """A SQLite database in a file (not in memory): several engines may open it."""
    database = make_url(url).database or "" if _is_sqlite(url) else ""
    return bool(database) and database != ":memory:" and not database.startswith("file:")


def write_gate_of(url: str) -> WriteGate | None:
    """The one `WriteGate` of this process for a SQLite file's writers (creating the file, private,
    when missing); None for other databases."""
    if not is_sqlite_file(url):
        return None
    return gate_for(str(private_sqlite_file(Path(make_url(url).database or ""))))


class FilePool(QueuePool):
    """The pool of a SQLite file's engine: a `QueuePool` that says how many connections it may
    hold at most (`checkout_free`)."""

    def __init__(self, creator: Any, pool_size: int = 5, max_overflow: int = 10, **kw: Any) -> None:
        super().__init__(creator, pool_size=pool_size, max_overflow=max_overflow, **kw)
        self.max_connections = pool_size + max_overflow


def checkout_free(engine: Engine) -> bool:
    """Whether a checkout from a SQLite file's engine now waits for no other thread: below its
    pool's limit it takes an idle connection or opens one. (Another thread may take the last
    one first; the checkout then waits, as any checkout would.)"""
    pool = engine.pool
    return isinstance(pool, FilePool) and pool.checkedout() < pool.max_connections


def _set_sqlite_pragmas(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    try:
        for pragma in _SQLITE_PRAGMAS:
            cur.execute(pragma)
    finally:
        cur.close()


def _set_sqlite_relaxed(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA synchronous=NORMAL")
    finally:
        cur.close()


def make_engine(url: str, *, durable_commits: bool = True, **kwargs: Any) -> Engine:
    """An engine with the store's connection settings; extra `kwargs` go to `create_engine`.
    Its errors never show SQL parameters (`hide_parameters`).

    `durable_commits=False` (SQLite): its commits do not fsync (`synchronous=NORMAL`); a power
    loss may undo its last commits, never corrupt the database, and the next durable commit of
    any connection makes them durable too. For records whose loss recovery repairs (a page row:
    its file becomes an orphan that start-up removes), so that they do not hold SQLite's one
    write lock through an fsync while a rollback waits for it. Ignored elsewhere.

    A SQLite file's connections (of every engine of this process) queue for its write lock in
    one `WriteGate` instead of polling SQLite's busy handler (`dss.db.write_gate`)."""
    parsed = make_url(url)
    # An error's message (logged, raised) never shows the statement's parameters: they are user
    # ids, messages, token ids. Always, whatever the caller passes.
    kwargs["hide_parameters"] = True
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        in_memory = database in ("", ":memory:") or database.startswith("file::memory:")
        if in_memory:
            # One shared connection, or every pooled connection would see its own empty database.
            kwargs.setdefault("poolclass", StaticPool)
            kwargs.setdefault("connect_args", {"check_same_thread": False})
            engine = create_engine(parsed, **kwargs)
        else:
            gate = write_gate_of(url)
            assert gate is not None
            connect_args = kwargs.setdefault("connect_args", {})
            connect_args.setdefault("factory", GatedConnection)
            kwargs.setdefault("poolclass", FilePool)
            engine = create_engine(parsed, **kwargs)

            def _set_gate(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
                if isinstance(dbapi_conn, GatedConnection):
                    dbapi_conn.gate = gate
                    dbapi_conn.timeout_s = BUSY_TIMEOUT_MS / 1000

            event.listen(engine, "connect", _set_gate)
        event.listen(engine, "connect", _set_sqlite_pragmas)
        if not durable_commits:
            event.listen(engine, "connect", _set_sqlite_relaxed)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(parsed, **kwargs)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def transaction(session_factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session inside one transaction: committed when the block succeeds, rolled back otherwise."""
    with session_factory() as session, session.begin():
        yield session


def alembic_config(url: str) -> Config:
    """An Alembic config pointing at the repository's migrations, independent of the cwd."""
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(f"migrations folder not found at {MIGRATIONS_DIR}")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolates '%', which appears in URL-encoded passwords.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade_to_head(url: str, engine: Engine | None = None) -> None:
    """Create or upgrade the schema; a no-op when it is already at head.

    Pass `engine` to migrate through it (needed for in-memory SQLite, whose data lives in the
    engine's one connection); otherwise the migration opens and closes its own engine. Safe to
    call from several processes at once: SQLite migrations hold a lock file next to the database,
    PostgreSQL ones an advisory lock (taken in `migrations/env.py`).
    """
    cfg = alembic_config(url)
    # Alembic's `context`/`op` are process-global proxies: one migration per process at a time.
    with _MIGRATE_LOCK, _sqlite_migration_lock(url if engine is None else None):
        if engine is not None:
            with engine.begin() as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
        else:
            command.upgrade(cfg, "head")


@contextmanager
def _sqlite_migration_lock(url: str | None) -> Iterator[None]:
    """An exclusive lock file beside a SQLite database file (created with its folder if needed)."""
    database = make_url(url).database if url is not None and _is_sqlite(url) else None
    if not database or database == ":memory:" or database.startswith("file:"):
        yield
        return
    path = private_sqlite_file(Path(database))
    lock_path = path.with_name(path.name + ".migrate.lock")
    with os.fdopen(os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600), "a+b") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def current_revision(url: str) -> str | None:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
