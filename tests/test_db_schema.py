"""The migrations create exactly the schema the models describe, on SQLite and PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from dss.db.engine import (
    current_revision,
    make_engine,
    make_session_factory,
    sqlite_url_for,
    transaction,
    upgrade_to_head,
)
from dss.db.models import Base, StoreMeta

EXPECTED_TABLES = {
    "store_meta",
    "data_keys",
    "sessions",
    "branches",
    "versions",
    "pages",
    "public_prefixes",
    "erasure_receipts",
    "api_keys",
    "erasure_epochs",
}


def _diff(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, Base.metadata))
    finally:
        engine.dispose()


def test_upgrade_creates_the_model_schema(db_url: str) -> None:
    assert current_revision(db_url) is None
    upgrade_to_head(db_url)
    assert current_revision(db_url) == "0002"
    assert _diff(db_url) == []
    engine = make_engine(db_url)
    try:
        assert set(inspect(engine).get_table_names()) == EXPECTED_TABLES | {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_twice_is_a_noop(db_url: str) -> None:
    upgrade_to_head(db_url)
    engine = make_engine(db_url)
    try:
        with transaction(make_session_factory(engine)) as db:
            db.add(StoreMeta(key="format", value="1"))
        upgrade_to_head(db_url)
        assert current_revision(db_url) == "0002"
        with engine.connect() as conn:
            assert conn.execute(text("SELECT value FROM store_meta WHERE key = 'format'")).scalar_one() == "1"
            assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar_one() == 1
    finally:
        engine.dispose()
    assert _diff(db_url) == []


def test_sqlite_engine_settings_and_dir_creation(tmp_path: Path) -> None:
    data_dir = tmp_path / "nested" / "data"
    url = sqlite_url_for(data_dir)
    assert url == f"sqlite:///{data_dir.resolve()}/dss.sqlite3"
    upgrade_to_head(url)
    assert (data_dir / "dss.sqlite3").is_file()
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar_one() == "wal"
            assert conn.execute(text("PRAGMA foreign_keys")).scalar_one() == 1
            assert conn.execute(text("PRAGMA busy_timeout")).scalar_one() == 5000
            assert conn.execute(text("PRAGMA synchronous")).scalar_one() == 1  # NORMAL
    finally:
        engine.dispose()


def test_upgrade_works_from_any_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'x.sqlite3'}"
    upgrade_to_head(url)
    assert current_revision(url) == "0002"


def test_in_memory_sqlite_migrates_through_the_given_engine() -> None:
    engine = make_engine("sqlite://")
    try:
        upgrade_to_head("sqlite://", engine=engine)
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            assert ctx.get_current_revision() == "0002"
            assert list(compare_metadata(ctx, Base.metadata)) == []
    finally:
        engine.dispose()


def test_transaction_rolls_back_on_error(sqlite_url: str) -> None:
    upgrade_to_head(sqlite_url)
    engine = make_engine(sqlite_url)
    factory = make_session_factory(engine)
    try:
        with pytest.raises(RuntimeError, match="boom"), transaction(factory) as db:
            db.add(StoreMeta(key="k", value="v"))
            db.flush()
            raise RuntimeError("boom")
        with transaction(factory) as db:
            assert db.get(StoreMeta, "k") is None
            db.add(StoreMeta(key="k", value="v2"))
        with transaction(factory) as db:
            row = db.get(StoreMeta, "k")
            assert row is not None and row.value == "v2"
    finally:
        engine.dispose()


def test_concurrent_upgrades_from_several_processes_agree(db_url: str) -> None:
    # Several servers starting at once against one database: one migrates, the rest find head.
    code = "import sys; from dss.db.engine import upgrade_to_head; upgrade_to_head(sys.argv[1])"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, db_url], stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs if p.wait(timeout=120) != 0]
    assert errors == []
    assert current_revision(db_url) == "0002"
    assert _diff(db_url) == []


def test_0002_upgrades_a_0001_database_with_data_in_it(db_url: str) -> None:
    from alembic import command

    from dss.db.engine import alembic_config

    command.upgrade(alembic_config(db_url), "0001")
    assert current_revision(db_url) == "0001"
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO store_meta (key, value) VALUES ('kept', 'yes')"))
            conn.execute(text("INSERT INTO sessions (id, user_id, version_count) VALUES ('s1', 'alice', 0)"))
        upgrade_to_head(db_url)
        assert current_revision(db_url) == "0002"
        with engine.connect() as conn:
            assert conn.execute(text("SELECT value FROM store_meta WHERE key = 'kept'")).scalar_one() == "yes"
            assert conn.execute(text("SELECT user_id FROM sessions WHERE id = 's1'")).scalar_one() == "alice"
            assert conn.execute(text("SELECT count(*) FROM erasure_epochs")).scalar_one() == 0
    finally:
        engine.dispose()
    assert _diff(db_url) == []
