"""Development mode is a flag (`dss serve --dev`), never a fallback; and no user takes the admin's
identity. Over the real app and store (FastAPI's test client) and one real `dss serve --dev`.

Before: a server without an active key ran unauthenticated with every caller an admin, and it
re-evaluated that on every request, so revoking the last key handed admin rights to anyone who
set `X-DSS-User`; in that mode any Host header was answered (DNS rebinding reached it from a web
page) and any bearer token was ignored; and `dss keys create --user admin` made a user key that
shared the admin keys' sessions.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert
from typer.testing import CliRunner

from api.app import create_app
from api.auth import ADMIN_USER
from api.cli import main as cli
from api.keys.api_keys import ApiKeys, hash_key
from api.settings import Settings, load_settings
from api.state import AppState
from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, transaction, upgrade_to_head
from dss.db.models import ApiKeyRow
from tests.api_server import ApiServer

# The test client's requests carry `Host: testserver`; the allow-list tests set Host themselves.
DEV = {"dev_mode": True, "dev_allowed_hosts": ["testserver"]}


def settings_for(data_dir: Path, **groups: dict[str, Any]) -> Settings:
    base: dict[str, dict[str, Any]] = {
        "store": {"data_dir": data_dir, "host_capacity_bytes": 16 << 20, "fsync": False},
        "engine": {"enabled": False},
        "auth": {"key_cache_ttl_s": 0},
    }
    for k, v in groups.items():
        base[k] = {**base.get(k, {}), **v}
    return load_settings(**base)


def started(c: TestClient) -> TestClient:
    deadline = time.monotonic() + 30
    while (r := c.get("/readyz", headers={"Host": "localhost"})).status_code != 200:
        assert r.status_code == 503 and time.monotonic() < deadline, r.text
        time.sleep(0.01)
    return c


def serve(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield started(c)


def make_key(data_dir: Path, user: str | None, admin: bool = False) -> tuple[str, str]:
    url = sqlite_url_for(data_dir)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        created = ApiKeys(make_session_factory(engine)).create(user, admin=admin)
        return created.id, created.key
    finally:
        engine.dispose()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def state_of(c: TestClient) -> AppState:
    state: AppState = c.app.state.dss  # type: ignore[attr-defined]
    return state


# ------------------------------------------------------------------------- never a fallback
def test_no_key_and_no_dev_flag_refuses_every_request(tmp_path: Path) -> None:
    for c in serve(settings_for(tmp_path / "data")):
        for headers in ({}, {"X-DSS-User": "mallory"}, bearer("dss-made-up")):
            r = c.get("/v1/sessions", headers=headers)
            assert r.status_code == 401, r.text
            msg = r.json()["error"]["message"]
            assert "dss keys create" in msg and "--dev" in msg, msg
        assert c.get("/metrics", headers={"X-DSS-User": "mallory"}).status_code == 401
        assert c.get("/readyz").json()["dev_mode"] is False


def test_revoking_the_last_key_does_not_switch_to_dev_mode(tmp_path: Path) -> None:
    data = tmp_path / "data"
    kid, key = make_key(data, "alice")
    for c in serve(settings_for(data)):
        assert c.post("/v1/sessions", json={"session_id": "a1"}, headers=bearer(key)).status_code == 201
        assert state_of(c).keys.revoke(kid)  # what `dss keys revoke` does, on the server's own keys
        for headers in (bearer(key), {"X-DSS-User": "alice"}, {}):
            r = c.get("/v1/sessions", headers=headers)
            assert r.status_code == 401, r.text
        assert c.delete("/v1/users/alice", headers={"X-DSS-User": "admin-now"}).status_code == 401
        fresh = state_of(c).keys.create("alice").key
        assert c.get("/v1/sessions/a1", headers=bearer(fresh)).status_code == 200  # nobody erased her


# ------------------------------------------------------------------------------ --dev itself
def test_dev_mode_answers_loopback_hosts_only(tmp_path: Path) -> None:
    settings = settings_for(tmp_path / "data", auth={"dev_mode": True, "dev_allowed_hosts": ["devbox.lan"]})
    for c in serve(settings):
        for host in ("localhost", "localhost:8000", "127.0.0.1:9", "[::1]:8000", "LOCALHOST", "devbox.lan:1"):
            r = c.get("/v1/sessions", headers={"Host": host, "X-DSS-User": "dev"})
            assert r.status_code == 200, (host, r.text)
        for host in ("testserver", "evil.example", "localhost.evil.example:8000", "127.0.0.2", "[::2]:80"):
            for path in ("/v1/sessions", "/healthz", "/metrics"):
                r = c.get(path, headers={"Host": host, "X-DSS-User": "dev"})
                assert r.status_code == 421, (host, path, r.text)
                err = r.json()["error"]
                assert err["code"] == "host_not_allowed" and err["type"] == "invalid_request_error"
                assert set(err) == {"message", "type", "param", "code"}


def test_dev_mode_checks_dss_keys_and_ignores_other_tokens(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _, alice = make_key(data, "alice")
    for c in serve(settings_for(data, auth=DEV)):
        # A real key acts as its owner, not as an admin, whatever X-DSS-User says.
        h = {**bearer(alice), "X-DSS-User": "bob"}
        assert c.post("/v1/sessions", json={"session_id": "mine"}, headers=h).status_code == 201
        assert c.get("/metrics", headers=h).status_code == 403
        assert c.get("/v1/sessions/mine", headers=bearer(alice)).status_code == 200
        assert c.get("/v1/sessions/mine", headers={"X-DSS-User": "bob"}).status_code == 404
        # A dss- token that is no key is refused, not turned into an admin.
        r = c.get("/v1/sessions", headers={**bearer("dss-typo"), "X-DSS-User": "bob"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        # The openai client's mandatory api_key ("dev", an OPENAI_API_KEY) counts as no key.
        for token in ("dev", "sk-proj-abc"):
            h = {**bearer(token), "X-DSS-User": "bob"}
            assert c.post("/v1/sessions", json={"session_id": f"b-{token}"}, headers=h).status_code == 201
            assert c.get("/metrics", headers=h).status_code == 200
        ids = [s["id"] for s in c.get("/v1/sessions", headers={"X-DSS-User": "bob"}).json()["data"]]
        assert ids == ["b-dev", "b-sk-proj-abc"]
        assert c.get("/readyz").json()["dev_mode"] is True


@pytest.mark.timeout(120)
def test_dss_serve_dev_over_http(tmp_path: Path) -> None:
    server = ApiServer(None, tmp_path, dev=True)  # `dss serve --dev --no-engine`
    server.start()
    try:
        base = server.base_url
        h = {"X-DSS-User": "dana"}
        assert httpx.post(base + "/v1/sessions", json={"session_id": "d1"}, headers=h).status_code == 201
        listed = httpx.get(base + "/v1/sessions", headers=h).json()["data"]
        assert [s["id"] for s in listed] == ["d1"]
        assert httpx.get(base + "/readyz").json()["dev_mode"] is True
        rebound = httpx.get(base + "/v1/sessions", headers={**h, "Host": f"attacker.example:{server.port}"})
        assert rebound.status_code == 421 and rebound.json()["error"]["code"] == "host_not_allowed"
    finally:
        server.stop()


# ---------------------------------------------------------------------- the admin's identity
def test_no_user_can_take_the_admin_identity(tmp_path: Path) -> None:
    data = tmp_path / "data"
    runner = CliRunner()
    res = runner.invoke(cli, ["keys", "create", "--user", ADMIN_USER, "--data-dir", str(data)])
    assert res.exit_code != 0 and "reserved" in res.output, res.output
    res = runner.invoke(cli, ["keys", "create", "--admin", "--user", "bob", "--data-dir", str(data)])
    assert res.exit_code != 0, res.output
    _, admin = make_key(data, None, admin=True)
    # A user key named "admin" made before the name was reserved.
    legacy = "dss-legacy-user-key-named-admin"
    engine = make_engine(sqlite_url_for(data))
    try:
        with transaction(make_session_factory(engine)) as db:
            row = {"id": "key_legacy", "key_hash": hash_key(legacy), "user_id": ADMIN_USER, "is_admin": False}
            db.execute(insert(ApiKeyRow).values(**row))
    finally:
        engine.dispose()
    for c in serve(settings_for(data)):
        assert c.post("/v1/sessions", json={"session_id": "ops"}, headers=bearer(admin)).status_code == 201
        r = c.get("/v1/sessions", headers=bearer(legacy))
        assert r.status_code == 401, r.text
        assert c.get("/v1/sessions/ops", headers=bearer(legacy)).status_code == 401
    for c in serve(settings_for(data, auth=DEV)):
        r = c.get("/v1/sessions", headers={"X-DSS-User": ADMIN_USER})
        assert r.status_code == 401 and "reserved" in r.json()["error"]["message"], r.text
        assert [s["id"] for s in c.get("/v1/sessions", headers=bearer(admin)).json()["data"]] == ["ops"]
