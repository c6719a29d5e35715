"""What may enter as an id or as text, over the real app and store (FastAPI's test client, no
engine) and the `dss` CLI.

Before: `dss keys create --user org/alice` (and `X-DSS-User: org/alice` in development mode) was
accepted, and then `DELETE /v1/users/org%2Falice` and `DELETE /v1/users/org/alice` answered 404
"no such endpoint" and the user's sessions stayed; there was no CLI to erase a user. A NUL in a
path, a query or any JSON string reached the database: PostgreSQL raised `DataError` (a 500 whose
logged traceback carried the SQL parameters: user ids, message text), SQLite stored it. Session ids
`.` and `..` were accepted (201) and then unreachable by clients that normalise URLs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import exc as sa_exc
from sqlalchemy import insert, text, update
from typer.testing import CliRunner

from api.app import create_app
from api.auth import Principal
from api.cli import main as cli
from api.http_errors import response_for
from api.keys.api_keys import ApiKeys, hash_key
from api.settings import Settings, load_settings
from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, transaction, upgrade_to_head
from dss.db.models import ApiKeyRow, ErasureReceiptRow
from dss.dialogue.versions import VersionStore
from dss.errors import InvalidSessionId, InvalidUserId
from dss.inputs import check_session_id, check_stored_user_id, check_user_id
from dss.types import UserId
from tests.api_server import ApiServer
from tests.store_helpers import SMALL_FP, pages_for, put_sequence

DEV = {"dev_mode": True, "dev_allowed_hosts": ["testserver"]}

# Accepted: anything printable up to 256 characters but '/', not blank.
GOOD_IDS = ["alice", "élodie", "a b", "a@b.example", "x.y:z", "o'brien", "日本語", "a+b=c", "x" * 256]
# Refused where an id enters (keys, the development-mode header and `user` field).
BAD_IDS = ["org/alice", "/", "a\x00b", "a\x01b", "a\tb", "a\nb", "a\x7fb", "a\x85b", "", "   ", "x" * 257]


def settings_for(data_dir: Path, db_url: str | None = None, **groups: dict[str, Any]) -> Settings:
    base: dict[str, dict[str, Any]] = {
        "store": {"data_dir": data_dir, "host_capacity_bytes": 16 << 20, "fsync": False},
        "engine": {"enabled": False},
        "auth": {"key_cache_ttl_s": 0},
    }
    if db_url is not None:
        base["store"]["db_url"] = db_url
    for k, v in groups.items():
        base[k] = {**base.get(k, {}), **v}
    return load_settings(**base)


def serve(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        deadline = time.monotonic() + 30
        while (r := c.get("/readyz")).status_code != 200:
            assert r.status_code == 503 and time.monotonic() < deadline, r.text
            time.sleep(0.01)
        yield c


def db_url_of(settings: Settings) -> str:
    return settings.store.to_config().resolved_db_url


def make_key(url: str, user: str | None, admin: bool = False) -> str:
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        return ApiKeys(make_session_factory(engine)).create(user, admin=admin).key
    finally:
        engine.dispose()


def legacy_user(url: str, user: str, sessions: list[str]) -> str:
    """A user as an earlier version stored it (a key row and sessions, written directly: today's
    key creation refuses the id); returns the key."""
    upgrade_to_head(url)
    engine = make_engine(url)
    key = "dss-legacy-" + hash_key(user)[:20]
    try:
        sf = make_session_factory(engine)
        with transaction(sf) as db:
            row = {
                "id": "key_" + hash_key(user)[:12],
                "key_hash": hash_key(key),
                "user_id": user,
                "is_admin": False,
            }
            db.execute(insert(ApiKeyRow).values(**row))
        versions = VersionStore(sf)
        for sid in sessions:
            versions.create_session(user, sid)
    finally:
        engine.dispose()
    return key


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def error_code(r: Any) -> str:
    code: str = r.json()["error"]["code"]
    return code


# ------------------------------------------------------------------------------- the domain rules
def test_the_user_id_rule_in_both_directions() -> None:
    for user in GOOD_IDS:
        assert check_user_id(user) == user
    for user in BAD_IDS:
        with pytest.raises(InvalidUserId):
            check_user_id(user)
    # What an earlier version may have stored stays nameable (to erase it): not NUL, not blank.
    for user in ["org/alice", "a\x01b", "a\x85b", *GOOD_IDS]:
        assert check_stored_user_id(user) == user
    for user in ["a\x00b", "", "  ", "x" * 257, "\ud800"]:
        with pytest.raises(InvalidUserId):
            check_stored_user_id(user)


def test_the_session_id_rule() -> None:
    for sid in ["a", "...", ".a", "a.", "s_1:2-3", "x" * 128]:
        assert check_session_id(sid) == sid
    for sid in [".", "..", "", "a/b", "a b", "a\x00", "x" * 129]:
        with pytest.raises(InvalidSessionId):
            check_session_id(sid)


# ---------------------------------------------------------------------- 1. every user erasable
def test_keys_refuse_user_ids_outside_the_alphabet(tmp_path: Path) -> None:
    data = tmp_path / "data"
    runner = CliRunner()
    for user in ["org/alice", "a\x01b", "a\x7fb", "a\x85b", "  ", "x" * 257]:
        res = runner.invoke(cli, ["keys", "create", "--user", user, "--data-dir", str(data)])
        assert res.exit_code == 2, (user, res.output)
        assert "user id" in res.output, res.output
    res = runner.invoke(cli, ["keys", "create", "--user", "org/alice", "--data-dir", str(data)])
    assert "'/'" in res.output, res.output
    url = db_url_of(settings_for(data))
    with pytest.raises(InvalidUserId, match="control"):
        make_key(url, "a\x00b")


def test_every_accepted_user_id_is_erasable(tmp_path: Path) -> None:
    data = tmp_path / "data"
    runner = CliRunner()
    keys = {}
    for user in GOOD_IDS:
        res = runner.invoke(cli, ["keys", "create", "--user", user, "--data-dir", str(data)])
        assert res.exit_code == 0, (user, res.output)
        keys[user] = res.stdout.strip().splitlines()[-1]
    admin = make_key(db_url_of(settings_for(data)), None, admin=True)
    for c in serve(settings_for(data)):
        for i, user in enumerate(GOOD_IDS):
            r = c.post("/v1/sessions", json={"session_id": "s"}, headers=bearer(keys[user]))
            assert r.status_code == 201, (user, r.text)
            # Half erased by an admin, half by the user themself.
            who = admin if i % 2 else keys[user]
            r = c.delete(f"/v1/users/{quote(user, safe='')}", headers=bearer(who))
            assert r.status_code == 200, (user, r.text)
            receipt = r.json()
            assert receipt["counts"]["sessions"] == 1 and receipt["verification"]["remnants"] == 0, receipt
            assert c.get("/v1/sessions", headers=bearer(keys[user])).json()["data"] == []


def test_a_legacy_user_with_a_slash_is_erasable(tmp_path: Path) -> None:
    data = tmp_path / "data"
    settings = settings_for(data)
    url = db_url_of(settings)
    alice = legacy_user(url, "org/alice", ["a1", "a2"])
    bob = legacy_user(url, "org/bob", ["b1"])
    carol = legacy_user(url, "org/carol", ["c1"])
    admin = make_key(url, None, admin=True)
    for c in serve(settings):
        # The legacy key still works: its user chats and creates sessions.
        assert c.post("/v1/sessions", json={"session_id": "a3"}, headers=bearer(alice)).status_code == 201
        # An admin, with the slash encoded.
        r = c.delete("/v1/users/org%2Falice", headers=bearer(admin))
        assert r.status_code == 200, r.text
        assert r.json()["counts"]["sessions"] == 3 and r.json()["verification"]["remnants"] == 0
        assert c.get("/v1/sessions", headers=bearer(alice)).json()["data"] == []
        # The user themself, with a raw slash.
        r = c.delete("/v1/users/org/bob", headers=bearer(bob))
        assert r.status_code == 200 and r.json()["counts"]["sessions"] == 1, r.text
        # Another user may not erase them (nor learn whether an id exists).
        for path in ["/v1/users/org/carol", "/v1/users/org/nobody"]:
            r = c.delete(path, headers=bearer(bob))
            assert r.status_code == 403, r.text
        # A legacy user whose only trace is KV (a sessionless chat): its tenant's data key.
        store = c.app.state.dss.store  # type: ignore[attr-defined]
        fid = store.fingerprints.register(SMALL_FP)
        toks = np.arange(100, 116, dtype=np.int32)
        put_sequence(store, fid, store.identity.tenant_for("org/kv"), toks, pages_for(SMALL_FP, toks))
        assert store.flush()
        r = c.delete("/v1/users/org%2Fkv", headers=bearer(admin))
        assert r.status_code == 200, r.text
        assert r.json()["counts"]["data_keys_destroyed"] == 1 and r.json()["counts"]["page_rows"] == 4
        assert r.json()["verification"]["remnants"] == 0
        # An id outside the rule that the store does not hold: refused, not an empty receipt.
        for path in ["/v1/users/org/nobody", "/v1/users/alice/", "/v1/users/a%01b"]:
            r = c.delete(path, headers=bearer(admin))
            assert r.status_code == 400 and error_code(r) == "invalid_user_id", (path, r.text)
        assert len(c.get("/v1/sessions", headers=bearer(carol)).json()["data"]) == 1


def test_development_mode_refuses_bad_user_ids_and_erases_good_ones(tmp_path: Path) -> None:
    for c in serve(settings_for(tmp_path / "data", auth=DEV)):
        for user in ["org/alice", "a\x7fb", "a\x85b", "a\tb", "x" * 257]:
            # As bytes: a header is Latin-1 on the wire (a C1 control is one byte of it).
            r = c.post(
                "/v1/sessions", json={"session_id": "s"}, headers={"X-DSS-User": user.encode("latin-1")}
            )
            assert r.status_code == 400 and error_code(r) == "invalid_user_id", (user, r.text)
        for user in ["alice", "a b", "a@b.example", "x.y:z", "o'brien"]:
            h = {"X-DSS-User": user}
            assert c.post("/v1/sessions", json={"session_id": "s"}, headers=h).status_code == 201
            r = c.delete(f"/v1/users/{quote(user, safe='')}", headers=h)
            assert r.status_code == 200 and r.json()["counts"]["sessions"] == 1, (user, r.text)
            assert c.get("/v1/sessions", headers=h).json()["data"] == []
        # The erasure path refuses ids outside the rule that the store does not hold.
        for path in ["/v1/users/org/alice", "/v1/users/a%7Fb", "/v1/users/%20%20", "/v1/users/" + "x" * 257]:
            r = c.delete(path)
            assert r.status_code == 400, (path, r.text)
    # The `user` field names the user in development mode: the same rule.
    dev = Principal(UserId("alice"), is_admin=True, key_id=None, dev_mode=True)
    assert dev.as_user("a b").user == "a b"
    for user in ["org/alice", "a\x00b", "a\x85b"]:
        with pytest.raises(InvalidUserId):
            dev.as_user(user)


@pytest.mark.parametrize("db", ["sqlite", pytest.param("pg", marks=pytest.mark.pg)])
def test_cli_erases_and_verifies_a_user(db: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    data = tmp_path / "data"
    db_url = None if db == "sqlite" else str(request.getfixturevalue("pg_url"))
    settings = settings_for(data, db_url)
    url = db_url_of(settings)
    legacy_user(url, "org/alice", ["a1", "a2"])
    runner = CliRunner()
    common = ["--data-dir", str(data), *(["--db-url", db_url] if db_url else [])]
    res = runner.invoke(cli, ["users", "erase", "org/alice", *common])
    assert res.exit_code == 0, res.output
    receipt = json.loads(res.stdout)
    assert receipt["counts"]["sessions"] == 2 and receipt["verification"]["remnants"] == 0, receipt
    assert receipt["verification"]["chain_ok"] is True
    res = runner.invoke(cli, ["users", "verify", receipt["id"], *common])
    assert res.exit_code == 0, res.output
    verification = json.loads(res.stdout)
    assert verification["remnants"] == 0 and verification["chain_ok"] is True, verification
    # Unknown receipt, refused id: one line, non-zero.
    res = runner.invoke(cli, ["users", "verify", "era_nope", *common])
    assert res.exit_code == 1 and "era_nope" in res.output, res.output
    for user in ["  ", "org/nobody"]:
        res = runner.invoke(cli, ["users", "erase", user, *common])
        assert res.exit_code == 2 and "user id" in res.output, res.output
    # A broken chain: the verification says so, and the exit status too.
    engine = make_engine(url)
    try:
        with transaction(make_session_factory(engine)) as db:
            db.execute(update(ErasureReceiptRow).values(entry_hash="0" * 64))
    finally:
        engine.dispose()
    res = runner.invoke(cli, ["users", "verify", receipt["id"], *common])
    assert res.exit_code == 1 and json.loads(res.stdout)["chain_ok"] is False, res.output
    # While a server owns the data directory: a clear refusal, nothing erased.
    for c in serve(settings):
        res = runner.invoke(cli, ["users", "erase", "bob", *common])
        assert res.exit_code == 2, res.output
        assert "DELETE /v1/users/" in res.output and "owns the data directory" in res.output, res.output
        assert c.get("/readyz").status_code == 200


# ---------------------------------------------------------------------------- 6. NUL, and logs
@pytest.mark.parametrize("db", ["sqlite", pytest.param("pg", marks=pytest.mark.pg)])
def test_nul_anywhere_is_a_400(db: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    db_url = None if db == "sqlite" else str(request.getfixturevalue("pg_url"))
    h = {"X-DSS-User": "alice"}
    for c in serve(settings_for(tmp_path / "data", db_url, auth=DEV)):
        created = c.post("/v1/sessions", json={"session_id": "s", "metadata": {"k": "v"}}, headers=h)
        assert created.status_code == 201, created.text
        cases: list[tuple[str, str, Any]] = [
            ("GET", "/v1/sessions/a%00b", None),
            ("DELETE", "/v1/sessions/a%00b", None),
            ("PATCH", "/v1/sessions/a%00b", {"metadata": {"k": "v"}}),
            ("GET", "/v1/sessions/s/versions/1%00", None),
            ("GET", "/v1/sessions?after=a%00b", None),
            ("DELETE", "/v1/users/%00", None),
            ("DELETE", "/v1/users/alice%00", None),
            ("GET", "/v1/responses/resp_%00", None),
            ("GET", "/v1/erasures/era_%00", None),
            ("POST", "/v1/sessions", {"session_id": "t1", "system_prompt": "be\x00nice"}),
            ("POST", "/v1/sessions", {"session_id": "t2", "metadata": {"k": "v\x00"}}),
            ("POST", "/v1/sessions", {"session_id": "t7", "system_prompt": "x" * (300 << 10) + "\x00"}),
            ("POST", "/v1/sessions", {"session_id": "t3", "metadata": {"k\x00": 1}}),
            ("POST", "/v1/sessions", {"session_id": "t4", "metadata": {"a": [{"b": ["\x00"]}]}}),
            ("PATCH", "/v1/sessions/s", {"metadata": {"k": "\x00"}}),
            ("POST", "/v1/sessions/s/branches", {"name": "b\x00", "from_version": 0}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi\x00"}]}),
            ("POST", "/v1/sessions/s/messages", {"content": "hi\x00"}),
            ("POST", "/v1/responses", {"input": "hi", "instructions": "\x00"}),
            ("POST", "/v1/prefixes", {"messages": [{"role": "system", "content": "\x00"}]}),
        ]
        for method, path, body in cases:
            r = c.request(method, path, json=body, headers=h)
            assert r.status_code == 400, (method, path, body, r.status_code, r.text)
            assert error_code(r) == "invalid_text" and "NUL" in r.json()["error"]["message"], r.text
        # Bodies that only hold such text after decoding: UTF-16 JSON (json reads it), and the
        # three UTF-8 bytes of a surrogate (json decodes bytes with "surrogatepass").
        raw = {"Content-Type": "application/json", **h}
        utf16 = json.dumps({"session_id": "t5", "system_prompt": "a\x00"}).encode("utf-16")
        r = c.post("/v1/sessions", content=utf16, headers=raw)
        assert r.status_code == 400 and error_code(r) == "invalid_text", r.text
        r = c.post(
            "/v1/sessions", content=b'{"session_id": "t6", "system_prompt": "a\xed\xa0\x80"}', headers=raw
        )
        assert r.status_code == 400 and error_code(r) == "invalid_unicode", r.text
        # Nothing of it was written, and the user's reads still work.
        listed = c.get("/v1/sessions", headers=h)
        assert listed.status_code == 200 and [s["id"] for s in listed.json()["data"]] == ["s"]
        assert c.get("/v1/sessions/s", headers=h).json()["metadata"] == {"k": "v"}


@pytest.mark.parametrize("db", ["sqlite", pytest.param("pg", marks=pytest.mark.pg)])
def test_engines_hide_sql_parameters(db: str, sqlite_url: str, request: pytest.FixtureRequest) -> None:
    url = sqlite_url if db == "sqlite" else str(request.getfixturevalue("pg_url"))
    engine = make_engine(url)
    try:
        assert engine.hide_parameters is True
        with pytest.raises(sa_exc.DBAPIError) as err, engine.connect() as conn:
            conn.execute(text("SELECT CAST(:v AS INTEGER) + nosuchcolumn"), {"v": "secret-user-text"})
        assert "secret-user-text" not in str(err.value), str(err.value)
    finally:
        engine.dispose()


def test_an_unexpected_database_error_is_logged_without_user_content(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # As SQLAlchemy raises it from an engine that shows parameters, with a driver message that
    # quotes a value (as PostgreSQL's DETAIL lines do).
    secret = "-".join(["secret", "user"])  # not in this file's source, which the stack quotes
    orig = Exception(f"duplicate key value: Key (user_id)=({secret}) already exists")
    try:
        raise sa_exc.IntegrityError("INSERT INTO sessions VALUES (:u)", {"u": secret}, orig)
    except sa_exc.IntegrityError as exc:
        with caplog.at_level(logging.ERROR, logger="dss.api"):
            r = response_for(exc)
    assert r.status_code == 500
    body = json.loads(bytes(r.body))
    assert body["error"]["code"] == "internal_error" and "secret" not in r.body.decode()
    assert caplog.records, "the error is logged"
    logged = "".join(logging.Formatter().format(rec) for rec in caplog.records)
    assert secret not in logged, logged
    assert "IntegrityError" in logged and "test_ids.py" in logged  # the kind and where it came from


# ------------------------------------------------------------------------------- 14. . and ..
def test_dot_session_ids_are_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    settings = settings_for(data, auth=DEV)
    url = db_url_of(settings)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:  # A session "." stored by an earlier version.
        with transaction(make_session_factory(engine)) as db:
            db.execute(
                text(
                    "INSERT INTO sessions (user_id, id, created_at, updated_at, version_count) "
                    "VALUES ('alice', '.', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 0)"
                )
            )
            db.execute(
                text(
                    "INSERT INTO branches (user_id, session_id, name, head_version, created_at) "
                    "VALUES ('alice', '.', 'main', 0, CURRENT_TIMESTAMP)"
                )
            )
    finally:
        engine.dispose()
    h = {"X-DSS-User": "alice"}
    for c in serve(settings):
        for sid in [".", ".."]:
            r = c.post("/v1/sessions", json={"session_id": sid}, headers=h)
            assert r.status_code == 400 and error_code(r) == "invalid_session_id", r.text
            r = c.post("/v1/sessions", json={}, headers={**h, "X-DSS-Session": sid})
            assert r.status_code == 400 and error_code(r) == "invalid_session_id", r.text
        for sid in ["...", ".a", "a.b"]:
            assert c.post("/v1/sessions", json={"session_id": sid}, headers=h).status_code == 201, sid
        # The stored one is still listed, and erased with its user.
        ids = [s["id"] for s in c.get("/v1/sessions", headers=h).json()["data"]]
        assert "." in ids, ids
        r = c.delete("/v1/users/alice", headers=h)
        assert r.status_code == 200 and r.json()["counts"]["sessions"] == 4, r.text


@pytest.mark.timeout(120)
def test_ids_over_http_with_dss_serve(tmp_path: Path) -> None:
    """Through uvicorn, which decodes a path once (the test client decodes it twice, so an id
    holding `%` only shows its real path here): `%2F` and a raw `/` both reach the erasure of a
    legacy id, an id holding `%` is its own user, a NUL in the path is a 400."""
    server = ApiServer(None, tmp_path, dev=True)  # `dss serve --dev --no-engine`
    legacy_user(sqlite_url_for(server.data_dir), "org/alice", ["a1"])
    legacy_user(sqlite_url_for(server.data_dir), "org/bob", ["b1"])
    server.start()
    try:
        base = server.base_url
        for user in ["a%2Fb", "100%", "a b@c.d"]:
            h = {"X-DSS-User": user}
            assert httpx.post(base + "/v1/sessions", json={"session_id": "s"}, headers=h).status_code == 201
            r = httpx.delete(f"{base}/v1/users/{quote(user, safe='')}", headers=h)
            assert r.status_code == 200 and r.json()["counts"]["sessions"] == 1, (user, r.text)
        for path in ["/v1/users/org%2Falice", "/v1/users/org/bob"]:
            r = httpx.delete(base + path)
            assert r.status_code == 200 and r.json()["counts"]["sessions"] == 1, (path, r.text)
        r = httpx.get(base + "/v1/sessions/a%00b", headers={"X-DSS-User": "dana"})
        assert r.status_code == 400 and error_code(r) == "invalid_text", r.text
        r = httpx.post(base + "/v1/sessions", json={"session_id": "s"}, headers={"X-DSS-User": "org/dana"})
        assert r.status_code == 400 and error_code(r) == "invalid_user_id", r.text
    finally:
        server.stop()
