"""The migrations create exactly the schema the models describe, on SQLite and PostgreSQL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from dss.db.connect import (
    current_revision,
    make_engine,
    make_session_factory,
    sqlite_url_for,
    transaction,
    upgrade_to_head,
)
from dss.db.models import Base, StoreMeta
from dss.pages.meta import PageMeta
from dss.types import FingerprintId, NamespaceId, PageHash, TenantId
from tests.db_helpers import HEAD_REVISION

HEAD = HEAD_REVISION

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
    "responses",
    "servers",
    "erasure_acks",
    "page_drops",
    "chain_checkpoints",
    "frontends",
    "admin_audit",
}


def _meta(h: bytes) -> PageMeta:
    return PageMeta(
        hash=PageHash(h),
        namespace=NamespaceId(b"\x02" * 16),
        tenant=TenantId("t1"),
        fingerprint=FingerprintId("fp"),
        parent=PageHash(b"\0" * 32),
        index=0,
        nbytes=16,
        tokens=np.array([1, 2], dtype="<i4"),
        checksum=b"c",
    )


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
    assert current_revision(db_url) == HEAD
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
        assert current_revision(db_url) == HEAD
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
            assert conn.execute(text("PRAGMA synchronous")).scalar_one() == 2  # FULL
    finally:
        engine.dispose()


def test_upgrade_works_from_any_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'x.sqlite3'}"
    upgrade_to_head(url)
    assert current_revision(url) == HEAD


def test_in_memory_sqlite_migrates_through_the_given_engine() -> None:
    engine = make_engine("sqlite://")
    try:
        upgrade_to_head("sqlite://", engine=engine)
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            assert ctx.get_current_revision() == HEAD
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
    code = "import sys; from dss.db.connect import upgrade_to_head; upgrade_to_head(sys.argv[1])"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, db_url], stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs if p.wait(timeout=120) != 0]
    assert errors == []
    assert current_revision(db_url) == HEAD
    assert _diff(db_url) == []


def test_0002_upgrades_a_0001_database_with_data_in_it(db_url: str) -> None:
    from alembic import command

    from dss.db.connect import alembic_config

    command.upgrade(alembic_config(db_url), "0001")
    assert current_revision(db_url) == "0001"
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO store_meta (key, value) VALUES ('kept', 'yes')"))
            conn.execute(text("INSERT INTO sessions (id, user_id, version_count) VALUES ('s1', 'alice', 0)"))
        upgrade_to_head(db_url)
        assert current_revision(db_url) == HEAD
        with engine.connect() as conn:
            assert conn.execute(text("SELECT value FROM store_meta WHERE key = 'kept'")).scalar_one() == "yes"
            assert conn.execute(text("SELECT user_id FROM sessions WHERE id = 's1'")).scalar_one() == "alice"
            assert conn.execute(text("SELECT count(*) FROM erasure_epochs")).scalar_one() == 0
    finally:
        engine.dispose()
    assert _diff(db_url) == []


def test_0003_rekeys_sessions_per_user_and_keeps_every_version(db_url: str) -> None:
    import json

    from alembic import command

    from dss.db.connect import alembic_config
    from dss.dialogue.versions import VersionStore

    command.upgrade(alembic_config(db_url), "0002")
    engine = make_engine(db_url)
    h1 = [{"role": "user", "content": "plan a day in Paris"}, {"role": "assistant", "content": "Louvre"}]
    h2 = [*h1, {"role": "user", "content": "cheaper"}, {"role": "assistant", "content": "walk"}]
    edit = [{"role": "user", "content": "plan a day in Rome"}, {"role": "assistant", "content": "Forum"}]
    try:
        with engine.begin() as conn:
            for sid, user in (("trip", "alice"), ("bob-1", "bob")):
                conn.execute(
                    text("INSERT INTO sessions (id, user_id, version_count) VALUES (:s, :u, 0)"),
                    {"s": sid, "u": user},
                )
                conn.execute(
                    text("INSERT INTO branches (session_id, name, head_version) VALUES (:s, 'main', 0)"),
                    {"s": sid},
                )
            rows = [(1, None, "main", h1), (2, 1, "main", h2), (3, None, "edit", edit)]
            for number, parent, branch, msgs in rows:
                conn.execute(
                    text(
                        "INSERT INTO versions (session_id, number, parent, branch, n_tokens, tokens,"
                        " messages) VALUES ('trip', :n, :p, :b, 2, :t, :m)"
                    ),
                    {
                        "n": number,
                        "p": parent,
                        "b": branch,
                        "t": b"\x01\0\0\0\x02\0\0\0",
                        "m": json.dumps(msgs),
                    },
                )
            conn.execute(text("UPDATE sessions SET version_count = 3 WHERE id = 'trip'"))
            conn.execute(text("UPDATE branches SET head_version = 2 WHERE session_id = 'trip'"))
            conn.execute(
                text("INSERT INTO branches (session_id, name, head_version) VALUES ('trip', 'edit', 3)")
            )
        upgrade_to_head(db_url)
        assert current_revision(db_url) == HEAD
        vs = VersionStore(make_session_factory(engine))
        assert vs.check() == []
        assert [v.messages for v in vs.list_versions("alice", "trip", with_body=True)] == [h1, h2, edit]
        assert vs.get_version("alice", "trip", 2).messages == h2
        assert vs.get_version("alice", "trip", 2).tokens.tolist() == [1, 2]
        assert vs.get_branch("alice", "trip", "edit").head_version == 3
        found = vs.find_deepest_prefix_version("alice", "trip", [*h2, {"role": "user", "content": "more"}])
        assert found is not None and found.number == 2
        # Stored once: version 2 keeps only what it added to version 1.
        with engine.connect() as conn:
            delta = conn.execute(text("SELECT messages FROM versions WHERE number = 2")).scalar_one()
            assert len(json.loads(delta) if isinstance(delta, str) else delta) == 2
        # The id is now per user: bob can have a "trip" of his own next to alice's.
        assert vs.ensure_session("bob", "trip")[1] is True
        assert vs.get_session("bob", "bob-1").version_count == 0
    finally:
        engine.dispose()
    assert _diff(db_url) == []


def test_0006_gives_page_rows_a_server_and_a_store_adopts_them(db_url: str) -> None:
    from alembic import command

    from dss.db.connect import alembic_config
    from dss.pages.rows import PageRows
    from tests.store_helpers import seed_one_version

    command.upgrade(alembic_config(db_url), "0005")
    engine = make_engine(db_url)
    try:
        seed_one_version(engine)
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO pages (hash, namespace, tenant, fingerprint, parent, page_index, n_tokens,"
                    " tokens, nbytes, disk_bytes, codec, checksum) VALUES (:h, :ns, 't1', 'fp', :p, 0, 2,"
                    " :t, 16, 20, 'zstd-byteplane', :c)"
                ),
                {
                    "h": b"\x01" * 32,
                    "ns": b"\x02" * 16,
                    "p": b"\0" * 32,
                    "t": b"\x01\0\0\0\x02\0\0\0",
                    "c": b"c",
                },
            )
        command.upgrade(alembic_config(db_url), "0006")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT server FROM pages")).scalars().all() == [""]
            assert conn.execute(text("SELECT count(*) FROM versions")).scalar_one() == 1
            assert conn.execute(text("SELECT count(*) FROM servers")).scalar_one() == 0
        # 0007 deletes rows holding plain token ids (a cache; recovery removes their files).
        upgrade_to_head(db_url)
        assert current_revision(db_url) == HEAD
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM pages")).scalar_one() == 0
            assert conn.execute(text("SELECT count(*) FROM versions")).scalar_one() == 1
        sf = make_session_factory(engine)
        key = b"k" * 32
        unowned = PageRows(sf, "zstd-byteplane", "")
        unowned.add(_meta(b"\x01" * 32), 20, key)  # a row as written before rows had servers
        other = PageRows(sf, "zstd-byteplane", "srv-other")
        assert other.all(lambda _t: key) == ([], [])  # not its row (yet): an unowned row is nobody's
        # A new server opening first, without the file, takes nothing; the one that holds it does.
        assert other.adopt_unowned(lambda _h: False) == 0 and other.all(lambda _t: key) == ([], [])
        mine = PageRows(sf, "zstd-byteplane", "srv-mine")
        assert mine.adopt_unowned(lambda h: h == b"\x01" * 32) == 1
        assert [meta.hash for meta, _ in mine.all(lambda _t: key)[0]] == [b"\x01" * 32]
        assert other.adopt_unowned(lambda _h: True) == 0 and other.all(lambda _t: key) == ([], [])
        # Two servers may now hold rows of the same page.
        other.add(mine.all(lambda _t: key)[0][0][0], 20, key)
        other.delete([b"\x01" * 32])  # type: ignore[list-item]
        assert len(mine.all(lambda _t: key)[0]) == 1 and other.all(lambda _t: key) == ([], [])
    finally:
        engine.dispose()
    assert _diff(db_url) == []
