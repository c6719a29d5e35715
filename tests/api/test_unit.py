"""The API without an engine: settings, error mapping, keys and auth modes, sessions, versions,
branches, erasure and metrics, over FastAPI's test client and a real store in a temp directory."""

from __future__ import annotations

import gc
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text as sa_text
from typer.testing import CliRunner

from api import state as api_state
from api.app import StartupRefused, create_app
from api.auth import bearer_token
from api.cli import main as cli
from api.http_errors import response_for, store_error_status
from api.keys import api_keys
from api.keys.api_keys import KEY_PREFIX, ApiKeys, hash_key
from api.settings import Settings, is_loopback_host, load_settings
from api.state import AppState
from dss import errors as e
from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, upgrade_to_head
from dss.namespace import make_namespace
from dss.store import Store
from dss.types import FingerprintId, TenantId
from tests.store_helpers import SMALL_FP, pages_for, put_sequence


def settings_for(data_dir: Path, **groups: dict[str, Any]) -> Settings:
    base: dict[str, dict[str, Any]] = {
        "store": {"data_dir": data_dir, "host_capacity_bytes": 16 << 20, "fsync": False},
        "engine": {"enabled": False},
    }
    for k, v in groups.items():
        base[k] = {**base.get(k, {}), **v}
    return load_settings(**base)


# Development mode as `dss serve --dev` has it, plus the test client's own Host name.
DEV = {"dev_mode": True, "dev_allowed_hosts": ["testserver"]}


def started(c: TestClient, timeout_s: float = 30.0) -> TestClient:
    """The client once `/readyz` says ready: the server listens (here: the test client runs the
    app) before its store is open."""
    deadline = time.monotonic() + timeout_s
    while (r := c.get("/readyz")).status_code != 200:
        assert r.status_code == 503 and "failed" not in r.json()["reason"], r.text
        assert time.monotonic() < deadline, r.text
        time.sleep(0.01)
    return c


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    """Development mode (`--dev`): users come from the X-DSS-User header."""
    with TestClient(create_app(settings_for(tmp_path / "data", auth=DEV))) as c:
        yield started(c)


def as_user(user: str) -> dict[str, str]:
    return {"X-DSS-User": user}


def state_of(c: TestClient) -> AppState:
    state: AppState = c.app.state.dss  # type: ignore[attr-defined]
    return state


def make_key(data_dir: Path, user: str | None, admin: bool = False) -> str:
    url = sqlite_url_for(data_dir)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        return ApiKeys(make_session_factory(engine)).create(user, admin=admin).key
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------------------ settings
def test_settings_come_from_nested_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DSS_STORE__HOST_CAPACITY_BYTES", str(3 << 30))
    monkeypatch.setenv("DSS_SERVER__PORT", "9001")
    monkeypatch.setenv("DSS_ENGINE__MAX_INFLIGHT", "3")
    monkeypatch.setenv("DSS_STORE__DB_URL", "postgresql+psycopg://u:secret@db/x")
    s = Settings()
    assert (s.store.host_capacity_bytes, s.server.port, s.engine.max_inflight) == (3 << 30, 9001, 3)
    assert "secret" not in repr(s)
    assert s.store.to_config().db_url == "postgresql+psycopg://u:secret@db/x"
    # Flags override single fields and keep the rest of the group from the environment.
    s2 = load_settings(server={"host": "0.0.0.0", "port": None}, store={"data_dir": tmp_path})
    assert (s2.server.host, s2.server.port) == ("0.0.0.0", 9001)
    assert s2.store.host_capacity_bytes == 3 << 30 and s2.store.to_config().data_dir == tmp_path.resolve()
    monkeypatch.setenv("DSS_SERVER__PORT", "not-a-port")
    with pytest.raises(ValueError):
        Settings()


def test_a_removed_setting_still_set_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device tier's settings are gone: set, they would otherwise be ignored without a word."""
    monkeypatch.setenv("DSS_STORE__DEVICE_CAPACITY_BYTES", str(1 << 30))
    with pytest.raises(ValueError, match="DSS_STORE__DEVICE_CAPACITY_BYTES is no longer a setting"):
        Settings()


def test_loopback_detection() -> None:
    assert is_loopback_host("127.0.0.1") and is_loopback_host("::1") and is_loopback_host("localhost")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("10.1.2.3")
    assert not is_loopback_host("example.com")


# ------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("exc", "status", "kind"),
    [
        (e.SessionNotFound("x"), 404, "not_found_error"),
        (e.BranchNotFound("x"), 404, "not_found_error"),
        (e.StaleHead("x"), 409, "conflict_error"),
        (e.NotAnAncestor("x"), 409, "conflict_error"),
        (e.BranchExists("x"), 409, "conflict_error"),
        (e.LimitExceeded("x"), 400, "invalid_request_error"),
        (e.InvalidInput("x"), 400, "invalid_request_error"),
        (e.CapacityError("x"), 503, "service_unavailable_error"),
        (e.CorruptPage("disk page abc at /secret/path"), 500, "server_error"),
        (e.WrongMasterKey("x"), 500, "server_error"),
        (e.MasterKeyRotated("x"), 503, "service_unavailable_error"),
    ],
)
def test_store_errors_map_to_openai_shaped_responses(exc: e.DSSError, status: int, kind: str) -> None:
    assert store_error_status(exc) == (status, kind)
    resp = response_for(exc)
    assert resp.status_code == status
    import json

    body = json.loads(bytes(resp.body))
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == kind
    if status == 500:
        assert "/secret/path" not in body["error"]["message"]  # no internals leak
    if status == 503:
        assert resp.headers["retry-after"] == "1"


def test_unexpected_errors_are_500_without_details() -> None:
    resp = response_for(RuntimeError("password=hunter2"))
    assert resp.status_code == 500 and b"hunter2" not in bytes(resp.body)


# --------------------------------------------------------------------------------------------- keys
def test_keys_are_stored_hashed_and_can_be_revoked(tmp_path: Path) -> None:
    url = sqlite_url_for(tmp_path)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        keys = ApiKeys(make_session_factory(engine), cache_ttl_s=0)
        assert not keys.any_active()
        created = keys.create("alice")
        admin = keys.create(None, admin=True)
        assert created.key.startswith(KEY_PREFIX) and len(created.key) > 40 and created.key != admin.key
        assert keys.any_active()
        p = keys.authenticate(created.key)
        assert p is not None and p.user == "alice" and not p.is_admin and p.key_id == created.id
        pa = keys.authenticate(admin.key)
        assert pa is not None and pa.is_admin
        assert keys.authenticate(created.key + "x") is None
        with pytest.raises(e.InvalidInput):
            keys.create(None)
        assert keys.revoke(created.id) and not keys.revoke(created.id)
        assert keys.authenticate(created.key) is None
        assert [k.revoked_at is not None for k in keys.list()] == [True, False]
    finally:
        engine.dispose()
    raw = b"".join(f.read_bytes() for f in tmp_path.glob("dss.sqlite3*"))
    assert created.key.encode() not in raw and hash_key(created.key).encode() in raw
    assert (
        bearer_token("Bearer abc") == "abc"
        and bearer_token("Basic abc") is None
        and bearer_token(None) is None
    )


def test_a_key_revoked_during_its_look_up_is_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A look-up that read the key before a revocation committed must not cache it afterwards:
    # the revoked key would then be accepted for the cache's whole lifetime.
    url = sqlite_url_for(tmp_path)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        keys = ApiKeys(make_session_factory(engine), cache_ttl_s=60)
        created = keys.create("alice")
        real, armed = api_keys.transaction, [True]

        @contextmanager
        def revoked_after_the_read(sf: Any) -> Iterator[Any]:
            with real(sf) as db:
                yield db
            if armed[0]:
                armed[0] = False
                keys.revoke(created.id)

        monkeypatch.setattr(api_keys, "transaction", revoked_after_the_read)
        assert keys.authenticate(created.key) is not None  # began before the revocation
        assert keys.cached(created.key) is None
        assert keys.authenticate(created.key) is None
    finally:
        engine.dispose()


def test_cli_creates_keys(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(cli, ["keys", "create", "--user", "alice", "--data-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    key = res.stdout.strip().splitlines()[-1]
    assert key.startswith(KEY_PREFIX)
    res = runner.invoke(cli, ["keys", "create", "--admin", "--data-dir", str(tmp_path)])
    assert res.exit_code == 0
    listing = runner.invoke(cli, ["keys", "list", "--data-dir", str(tmp_path)])
    assert "alice" in listing.stdout and "admin" in listing.stdout and key not in listing.stdout
    assert runner.invoke(cli, ["keys", "create", "--data-dir", str(tmp_path)]).exit_code != 0
    engine = make_engine(sqlite_url_for(tmp_path))
    try:
        p = ApiKeys(make_session_factory(engine)).authenticate(key)
        assert p is not None and p.user == "alice"
    finally:
        engine.dispose()


@pytest.mark.timeout(60)
def test_cli_serve_refuses_dev_mode_on_a_public_bind(tmp_path: Path) -> None:
    args = ["serve", "--dev", "--no-engine", "--data-dir", str(tmp_path), "--host", "0.0.0.0", "--port", "0"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2 and "refusing development mode on 0.0.0.0" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


# ---------------------------------------------------------------------------------------- auth modes
def test_keys_required_once_any_exists(tmp_path: Path) -> None:
    data = tmp_path / "data"
    alice, admin = make_key(data, "alice"), make_key(data, None, admin=True)
    with TestClient(create_app(settings_for(data))) as c:
        started(c)
        assert c.get("/v1/sessions").status_code == 401
        assert c.get("/v1/sessions", headers=as_user("alice")).status_code == 401
        r = c.get("/v1/sessions", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        auth = {"Authorization": f"Bearer {alice}"}
        assert c.post("/v1/sessions", json={"session_id": "a1"}, headers=auth).status_code == 201
        assert c.get("/metrics", headers=auth).status_code == 403
        assert c.delete("/v1/users/bob", headers=auth).status_code == 403
        assert c.post("/v1/prefixes", json={"text": "x" * 50}, headers=auth).status_code in (403, 503)
        assert c.get("/metrics", headers={"Authorization": f"Bearer {admin}"}).status_code == 200
        assert c.get("/readyz").json()["dev_mode"] is False
        assert c.get("/healthz").status_code == 200


def test_dev_mode_on_a_public_bind_refuses_to_start(tmp_path: Path) -> None:
    app = create_app(settings_for(tmp_path / "data", server={"host": "0.0.0.0"}, auth=DEV))
    with pytest.raises(StartupRefused, match="refusing development mode"), TestClient(app):
        pass
    # Without --dev a public bind starts, keys or not (the test client never binds the address).
    with TestClient(create_app(settings_for(tmp_path / "data", server={"host": "0.0.0.0"}))) as c:
        assert started(c).get("/v1/sessions").status_code == 401


# ------------------------------------------------------------------------------------- bad input
def test_a_ready_server_keeps_its_start_up_heap_out_of_full_collections(tmp_path: Path) -> None:
    """A full collection walked every object start-up made (~800,000 with the engine's client and
    the tokenizer), stopping the server for 385 ms about once a minute under `bench/api_load.py`
    (issue 31). Ready means frozen; stopped means collectable again."""
    gc.unfreeze()
    with TestClient(create_app(settings_for(tmp_path / "data", auth=DEV))) as c:
        started(c)
        assert gc.get_freeze_count() > 0
        cycle = Cycle()  # what serving allocates stays collectable
        cycle.me = cycle
        dead = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert dead() is None
    assert gc.get_freeze_count() == 0


class Cycle:
    me: object = None


def test_huge_version_numbers_and_lone_surrogates_are_4xx(client: TestClient) -> None:
    """Both answered 500: the number overflowed the database driver, the text its UTF-8 encoder."""
    h = {**as_user("alice"), "content-type": "application/json"}
    assert client.post("/v1/sessions", json={"session_id": "trip"}, headers=h).status_code == 201
    for n in ("99999999999999999999", "9223372036854775808", "-99999999999999999999"):
        r = client.get(f"/v1/sessions/trip/versions/{n}", headers=h)
        assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found", r.text
    r = client.post("/v1/sessions/trip/branches", json={"from_version": 10**20, "name": "b"}, headers=h)
    assert r.status_code in (400, 404), r.text
    lone = b'{"session_id": "s2", "system_prompt": "caf\\ud800"}'
    r = client.post("/v1/sessions", content=lone, headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text


def test_chat_text_with_a_lone_surrogate_is_refused_before_the_engine(client: TestClient) -> None:
    # One check of every request's text (`api.deps.check_request_text`), before the route runs.
    h = {**as_user("alice"), "content-type": "application/json"}
    for lone in (
        b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
        b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\udc00"]}',
    ):
        r = client.post("/v1/chat/completions", content=lone, headers=h)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", r.text


def test_bad_input_is_400_and_unknown_fields_are_ignored(client: TestClient) -> None:
    h = {**as_user("alice"), "content-type": "application/json"}
    r = client.post("/v1/sessions", content=b'{"session_id": ', headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post("/v1/sessions", json={"session_id": "bad id!"}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"
    r = client.post("/v1/sessions", json={"session_id": "ok", "tenant": "public", "zzz": [1]}, headers=h)
    assert r.status_code == 201 and r.json()["id"] == "ok"
    assert client.post("/v1/sessions", json={"session_id": "ok"}, headers=h).status_code == 409
    r = client.get("/v1/sessions?limit=0", headers=h)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.get("/v1/nothing-here", headers=h)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, headers=h)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert "retry-after" in r.headers


def test_body_size_limit(tmp_path: Path) -> None:
    settings = settings_for(tmp_path / "d", server={"max_body_bytes": 2048}, auth=DEV)
    with TestClient(create_app(settings)) as c:
        started(c)
        r = c.post("/v1/sessions", json={"system_prompt": "x" * 4096}, headers=as_user("a"))
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
            yield b'{"system_prompt": "'
            for _ in range(8):
                yield b"y" * 512
            yield b'"}'

        r = c.post(
            "/v1/sessions", content=chunks(), headers={**as_user("a"), "content-type": "application/json"}
        )
        assert r.status_code == 413
        assert (
            c.post("/v1/sessions", json={"system_prompt": "short"}, headers=as_user("a")).status_code == 201
        )


# ------------------------------------------------------------------------- sessions, versions, branches
def test_sessions_are_per_user_and_paginated(client: TestClient) -> None:
    for i in range(5):
        assert (
            client.post("/v1/sessions", json={"session_id": f"s{i}"}, headers=as_user("alice")).status_code
            == 201
        )
    page1 = client.get("/v1/sessions?limit=2", headers=as_user("alice")).json()
    assert (
        page1["object"] == "list" and [s["id"] for s in page1["data"]] == ["s0", "s1"] and page1["has_more"]
    )
    page3 = client.get(f"/v1/sessions?limit=2&after={page1['last_id']}", headers=as_user("alice")).json()
    assert [s["id"] for s in page3["data"]] == ["s2", "s3"]
    last = client.get("/v1/sessions?limit=2&after=s3", headers=as_user("alice")).json()
    assert [s["id"] for s in last["data"]] == ["s4"] and not last["has_more"]
    assert client.get("/v1/sessions", headers=as_user("bob")).json()["data"] == []
    assert client.get("/v1/sessions/s0", headers=as_user("bob")).status_code == 404
    assert client.delete("/v1/sessions/s0", headers=as_user("bob")).status_code == 404
    r = client.delete("/v1/sessions/s0", headers=as_user("alice"))
    assert r.status_code == 200 and r.json() == {"id": "s0", "object": "session.deleted", "deleted": True}
    assert client.get("/v1/sessions/s0", headers=as_user("alice")).status_code == 404


def _commit(c: TestClient, user: str, sid: str, n: int, branch: str = "main") -> None:
    store = state_of(c).store
    for i in range(n):
        msgs = [{"role": "user", "content": f"{sid} {branch} {i}"}]
        store.versions.commit(
            user, sid, tokens=np.arange(8 + i, dtype=np.int32), messages=msgs, branch=branch
        )


def test_versions_rollback_and_branches(client: TestClient) -> None:
    h = as_user("alice")
    client.post("/v1/sessions", json={"session_id": "v"}, headers=h)
    _commit(client, "alice", "v", 3)
    listing = client.get("/v1/sessions/v/versions", headers=h).json()["data"]
    assert [(v["number"], v["parent"], v["branch"]) for v in listing] == [
        (1, None, "main"),
        (2, 1, "main"),
        (3, 2, "main"),
    ]
    assert listing[0]["resident"] == {"host": 0, "disk": 0, "remote": 0}
    v2 = client.get("/v1/sessions/v/versions/2", headers=h).json()
    assert v2["messages"] == [{"role": "user", "content": "v main 1"}] and v2["n_tokens"] == 9
    assert client.get("/v1/sessions/v/versions/9", headers=h).status_code == 404
    assert client.get("/v1/sessions/v/versions/x", headers=h).status_code == 400
    r = client.post("/v1/sessions/v/rollback", json={"to_version": 1}, headers=h)
    assert r.status_code == 200 and r.json()["head_version"] == 1
    assert client.post("/v1/sessions/v/rollback", json={"to_version": 3}, headers=h).status_code == 409
    r = client.post("/v1/sessions/v/branches", json={"from_version": 3, "name": "keep"}, headers=h)
    assert r.status_code == 201 and r.json()["head_version"] == 3
    assert (
        client.post(
            "/v1/sessions/v/branches", json={"from_version": 2, "name": "keep"}, headers=h
        ).status_code
        == 409
    )
    assert (
        client.post(
            "/v1/sessions/v/branches", json={"from_version": 2, "name": "b a d"}, headers=h
        ).status_code
        == 400
    )
    names = [b["name"] for b in client.get("/v1/sessions/v/branches", headers=h).json()["data"]]
    assert names == ["main", "keep"]
    session = client.get("/v1/sessions/v", headers=h).json()
    assert session["version_count"] == 3 and {b["name"]: b["head_version"] for b in session["branches"]} == {
        "main": 1,
        "keep": 3,
    }
    assert client.get("/v1/sessions/v/branches", headers=as_user("eve")).status_code == 404


def test_erasure_over_the_api(client: TestClient) -> None:
    client.post("/v1/sessions", json={"session_id": "e1"}, headers=as_user("erin"))
    _commit(client, "erin", "e1", 2)
    r = client.delete("/v1/users/erin", headers=as_user("erin"))
    assert r.status_code == 200
    receipt = r.json()
    assert receipt["counts"]["sessions"] == 1 and receipt["counts"]["versions"] == 2
    assert receipt["verification"]["remnants"] == 0 and "erin" not in r.text
    assert client.get("/v1/sessions", headers=as_user("erin")).json()["data"] == []
    again = client.get(f"/v1/erasures/{receipt['id']}", headers=as_user("erin")).json()
    assert again["id"] == receipt["id"] and again["verification"]["remnants"] == 0
    assert client.get("/v1/erasures/era_nope", headers=as_user("erin")).status_code == 404
    m = client.get("/metrics").text
    assert "dss_erasures_total 1.0" in m and "erin" not in m


# ---------------------------------------------------------------------- deleting a session's pages
def _pages_on_path(store: Store, tenant: str, tokens: np.ndarray) -> int:
    return store.kv.match(SMALL_FP.id, tenant, tokens).n_tokens // SMALL_FP.block_size  # type: ignore[arg-type]


def _host_pages(store: Store) -> int:
    pages = store.stats()["pages"]
    assert isinstance(pages, dict)
    return int(pages["host"])


def _drop_paths(store: Store, fid: FingerprintId, tenant: str, seqs: list[np.ndarray]) -> int:
    """What deleting a session does with its paths: cut them from the index, drop the pages."""
    cut = store.index.remove_paths(make_namespace(fid, TenantId(tenant)), seqs, [])
    return len(store.pages.copies.drop(cut))


def test_dropping_a_sequence_keeps_public_prefix_pages(tmp_path: Path) -> None:
    from tests.store_helpers import open_store

    with open_store(tmp_path / "s") as store:
        fid = store.fingerprints.register(SMALL_FP)
        public = np.arange(1, 9, dtype=np.int32)  # two pages
        store.prefixes.register(fid, public)
        put_sequence(store, fid, "public", public, pages_for(SMALL_FP, public))  # type: ignore[arg-type]
        tenant = store.identity.tenant_for("pat")
        mine = np.concatenate([public, np.arange(50, 58, dtype=np.int32)])
        put_sequence(store, fid, tenant, mine, pages_for(SMALL_FP, mine))
        assert store.kv.match(fid, tenant, mine).n_tokens == 16
        assert _drop_paths(store, fid, "public", [public]) == 0  # public pages go with their prefix
        assert _drop_paths(store, fid, tenant, [mine]) == 2
        assert store.kv.match(fid, tenant, mine).n_tokens == 8  # the public pages still serve her
        assert store.kv.match(fid, store.identity.tenant_for("quinn"), public).n_tokens == 8
        assert _drop_paths(store, fid, store.identity.tenant_for("nobody"), [mine]) == 0
        store.check()


def test_deleting_a_session_drops_only_its_own_pages(client: TestClient) -> None:
    store = state_of(client).store
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for("dana")
    shared = np.arange(100, 108, dtype=np.int32)  # two pages both sessions start with
    only_a = np.concatenate([shared, np.arange(500, 512, dtype=np.int32)])
    only_b = np.concatenate([shared, np.arange(700, 708, dtype=np.int32)])
    for sid, toks in (("a", only_a), ("b", only_b)):
        client.post("/v1/sessions", json={"session_id": sid}, headers=as_user("dana"))
        store.versions.commit(
            "dana", sid, tokens=toks, messages=[{"role": "user", "content": sid}], fingerprint=fid
        )
        put_sequence(store, fid, tenant, toks, pages_for(SMALL_FP, toks))
    assert _pages_on_path(store, tenant, only_a) == 5 and _pages_on_path(store, tenant, only_b) == 4
    before = _host_pages(store)
    assert client.delete("/v1/sessions/a", headers=as_user("dana")).status_code == 200
    assert _pages_on_path(store, tenant, only_a) == 2  # the shared pages stay for session b
    assert _pages_on_path(store, tenant, only_b) == 4
    assert _host_pages(store) == before - 3
    store.check()
    # The last session goes with all of its pages.
    assert client.delete("/v1/sessions/b", headers=as_user("dana")).status_code == 200
    assert _pages_on_path(store, tenant, only_b) == 0
    store.check()


# --------------------------------------------------------------------------------------- admission
def test_engine_admission_answers_503_with_retry_after() -> None:
    import asyncio

    from api.http_errors import EngineOverloaded
    from api.llm.chat_engine import ChatEngine

    engine = ChatEngine(
        None, None, model_name="m", max_model_len=64, fingerprint=None, max_inflight=1, retry_after_s=3,
        tag_key=b"k" * 32,
    )  # fmt: skip
    seen: list[int] = []
    engine.slots.on_change = seen.append

    async def scenario() -> None:
        async with engine.slots.admitted():
            with pytest.raises(EngineOverloaded) as info:
                async with engine.slots.admitted():
                    pass
            resp = response_for(info.value)
            assert resp.status_code == 503 and resp.headers["retry-after"] == "3"
            async with engine.slots.admitted(strict=False):  # a stream already promised its 200
                pass
        async with engine.slots.admitted():
            pass

    asyncio.run(scenario())
    assert seen == [1, 2, 1, 0, 1, 0]
    assert engine.check_length(10, None, 16) == 16 and engine.check_length(60, None, 16) == 4
    with pytest.raises(Exception, match="maximum context length is 64 tokens"):
        engine.check_length(60, 8, 16)


# ------------------------------------------------------------------------------------------ metrics
def _short_writes(c: TestClient) -> dict[str, float]:
    """Where the server ran its short metadata writes (`dss_short_writes_total`)."""
    prefix = 'dss_short_writes_total{ran_on="'
    lines = [ln[len(prefix) :] for ln in c.get("/metrics").text.splitlines() if ln.startswith(prefix)]
    return {ln.split('"')[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines}


def test_a_rollback_runs_on_the_event_loop_unless_it_would_wait_there(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31 (rollback p99 under load): a rollback runs on the event loop (on a thread it
    waited for the GIL at each SQLite call); while another writer of the process is inside
    SQLite's lock the loop waits for the gate kept for it; a writer inside longer than the loop
    waits sends it to a thread. Every way, it lands."""
    h = as_user("alice")
    client.post("/v1/sessions", json={"session_id": "w"}, headers=h)
    _commit(client, "alice", "w", 4)
    assert client.post("/v1/sessions/w/rollback", json={"to_version": 3}, headers=h).status_code == 200
    assert _short_writes(client) == {"loop": 1.0, "thread": 0.0}
    store = state_of(client).store

    def rollback_behind_a_writer(to_version: int, held_s: float) -> float:
        holding, release = threading.Event(), threading.Event()

        def holder() -> None:
            with store.db.begin() as conn:  # a write of another thread, inside the lock until released
                conn.execute(sa_text("UPDATE sessions SET updated_at = updated_at WHERE 0"))
                holding.set()
                release.wait(5)

        t = threading.Thread(target=holder)
        t.start()
        assert holding.wait(5)
        threading.Timer(held_s, release.set).start()
        start = time.perf_counter()
        r = client.post("/v1/sessions/w/rollback", json={"to_version": to_version}, headers=h)
        t.join(5)
        assert r.status_code == 200 and r.json()["head_version"] == to_version
        return time.perf_counter() - start

    assert rollback_behind_a_writer(2, held_s=0.3) >= 0.25
    assert _short_writes(client) == {"loop": 2.0, "thread": 0.0}
    monkeypatch.setattr(api_state, "RESERVATION_WAIT_S", 0.05)
    assert rollback_behind_a_writer(1, held_s=0.3) >= 0.25
    assert _short_writes(client) == {"loop": 2.0, "thread": 1.0}
    r = client.post("/v1/sessions/w/branches", json={"from_version": 3, "name": "b"}, headers=h)
    assert r.status_code == 201 and _short_writes(client) == {"loop": 3.0, "thread": 1.0}
    assert store.write_gate is not None and store.write_gate.free()
    assert "dss_event_loop_lag_seconds_count" in client.get("/metrics").text


def test_metrics_and_openapi(client: TestClient) -> None:
    client.get("/v1/sessions/abc", headers=as_user("zed"))
    text = client.get("/metrics").text
    assert 'dss_http_requests_total{method="GET",route="/v1/sessions/{session_id}",status="404"} 1.0' in text
    for name in (
        "dss_pages{tier=",
        "dss_tier_capacity_bytes{tier=",
        "dss_evictions_total{tier=",
        "dss_corrupt_pages_total",
        "dss_ttft_seconds_bucket",
        "dss_request_duration_seconds_bucket",
    ):
        assert name in text, name  # fmt: skip
    assert "zed" not in text and "abc" not in text
    paths = set(client.get("/openapi.json").json()["paths"])
    assert {
        "/v1/chat/completions", "/v1/sessions", "/v1/sessions/{session_id}",
        "/v1/sessions/{session_id}/messages",
        "/v1/sessions/{session_id}/versions", "/v1/sessions/{session_id}/versions/{number}",
        "/v1/sessions/{session_id}/rollback", "/v1/sessions/{session_id}/branches", "/v1/users/{user_id}",
        "/v1/erasures/{receipt_id}", "/v1/prefixes", "/v1/prefixes/{prefix_id}", "/v1/models", "/healthz",
        "/readyz", "/metrics",
    } <= paths  # fmt: skip


def test_sqlite_file_never_holds_a_plain_key(tmp_path: Path) -> None:
    key = make_key(tmp_path, "alice")
    conn = sqlite3.connect(tmp_path / "dss.sqlite3")
    try:
        rows = conn.execute("SELECT key_hash, user_id FROM api_keys").fetchall()
    finally:
        conn.close()
    assert rows == [(hash_key(key), "alice")]


def test_a_report_that_caching_went_off_in_the_engine_turns_readyz_and_the_gauge() -> None:
    from api.llm.chat_engine import ChatEngine
    from dss.wire import TurnReport

    engine = ChatEngine(
        None, None, model_name="m", max_model_len=64, fingerprint=None, max_inflight=1, retry_after_s=3,
        tag_key=b"k" * 32,
    )  # fmt: skip
    seen: list[bool] = []
    engine.on_caching_change = seen.append
    engine.note_report(TurnReport("s", "f"))
    assert engine.kv_caching and seen == []
    off = TurnReport.from_params({**TurnReport("s", "f").to_params(), "caching_off": "a worker ..."})
    engine.note_report(off)
    engine.note_report(off)
    assert not engine.kv_caching and engine.uncached_reason == "a worker ..." and seen == [False]
