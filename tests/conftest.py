"""Shared pytest fixtures.

Database fixtures: `sqlite_url` (a fresh file), `pg_url` (a throwaway PostgreSQL database on the
server named by DSS_TEST_PG_URL), `db_url` (both, parametrised), and `session_factory` (a migrated
database of the `db_url` kind). PostgreSQL tests skip when the server does not answer, except
under CI (env `CI` set), where that is a failure: CI must exercise PostgreSQL.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import make_engine, make_session_factory, upgrade_to_head
from tests.paths import REPO

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'db' / 'dss.sqlite3'}"


@contextlib.contextmanager
def fresh_pg_database() -> Iterator[str]:
    """A new, empty PostgreSQL database on the test server (dropped afterwards); skips (fails in
    CI) when none answers."""
    server = make_url(os.environ.get("DSS_TEST_PG_URL", DEFAULT_PG_URL))
    name = f"dss_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as exc:
        admin.dispose()
        if os.environ.get("CI"):
            pytest.fail(
                f"PostgreSQL at {server.render_as_string(hide_password=True)} is required in CI: {exc}"
            )
        pytest.skip(f"PostgreSQL not reachable at {server.render_as_string(hide_password=True)}")
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            # FORCE: a test that failed half-way may still hold pooled connections.
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def pg_url() -> Iterator[str]:
    with fresh_pg_database() as url:
        yield url


@pytest.fixture(scope="module")
def module_pg_url() -> Iterator[str]:
    """One database for a module's tests (e.g. servers started once per module)."""
    with fresh_pg_database() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("pg", marks=pytest.mark.pg)])
def db_url(request: pytest.FixtureRequest) -> str:
    fixture = "sqlite_url" if request.param == "sqlite" else "pg_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture
def session_factory(db_url: str) -> Iterator[sessionmaker[Session]]:
    """A migrated, empty database of each kind `db_url` names."""
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    try:
        yield make_session_factory(engine)
    finally:
        engine.dispose()


_SHARED_SERVER_TESTS = REPO / "tests" / "api"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The servers tests share (tests/api_server.py) serve tests/api only: stopped before any test
    elsewhere, where tests start engines of their own. Left running, the shared default, small and
    parity servers held about 11 GiB for the whole run, and on a 2-core, 24 GiB machine serving
    float32 (no AVX-512) the kernel's OOM killer took an engine worker while the cluster smoke ran
    three more servers (stop 34's CI: "engine not healthy"; every file page evicted on the way)."""
    servers = sys.modules.get("tests.api_server")  # not imported: no server was started
    if servers is not None and not item.path.is_relative_to(_SHARED_SERVER_TESTS):
        servers.stop_servers()
