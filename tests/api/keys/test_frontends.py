"""Frontend keys (issue 22, items 1-3), without the engine: one key per frontend acting for many
end users, each a DSS user of its own (`webui/alice`), named by the request's headers; keys and
frontends over REST with an audit trail; `dss keys create --frontend`; the session named by
vLLM's `X-Session-ID` or the frontend's own header; the migration on SQLite and PostgreSQL.

The routes whose body names the end user (chat, Responses) need the engine:
`tests/api/keys/test_frontend_turns.py` checks them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from typer.testing import CliRunner

from api.app import create_app
from api.cli import main as cli
from api.keys.api_keys import KEY_PREFIX, ApiKeys
from api.keys.audit import AuditTrail
from dss.db.connect import current_revision, make_engine, make_session_factory, upgrade_to_head
from dss.types import SessionId, UserId
from tests.api.test_unit import settings_for, started, state_of
from tests.db_helpers import HEAD_REVISION

WEBUI_USER = "X-OpenWebUI-User-Id"
WEBUI_CHAT = "X-OpenWebUI-Chat-Id"


def cli_key(data: Path, *args: str) -> str:
    res = CliRunner().invoke(cli, ["keys", "create", *args, "--data-dir", str(data)])
    assert res.exit_code == 0, res.output
    key = res.stdout.strip().splitlines()[-1]
    assert key.startswith(KEY_PREFIX)
    return key


class Keys:
    """The keys of one server: an admin, a user `carol`, frontends `webui` (trusting Open WebUI's
    headers) and `lc` (LibreChat-like: no header of its own)."""

    def __init__(self, data: Path) -> None:
        self.admin = cli_key(data, "--admin")
        self.carol = cli_key(data, "--user", "carol")
        self.webui = cli_key(
            data, "--frontend", "webui", "--user-header", WEBUI_USER, "--session-header", WEBUI_CHAT
        )
        self.lc = cli_key(data, "--frontend", "lc")


def auth(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **headers}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[TestClient, Keys]]:
    data = tmp_path / "data"
    keys = Keys(data)
    with TestClient(create_app(settings_for(data))) as c:
        yield started(c, timeout_s=180), keys  # a loaded machine opens a store slowly


def error(r: Any, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    return err


def session_ids(c: TestClient, headers: dict[str, str]) -> list[str]:
    r = c.get("/v1/sessions", headers=headers)
    assert r.status_code == 200, r.text
    return [s["id"] for s in r.json()["data"]]


def test_each_end_user_of_each_frontend_is_a_user_of_its_own(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    alice = auth(k.webui, **{WEBUI_USER: "alice"})
    bob = auth(k.webui, **{"X-DSS-User": "bob"})  # X-DSS-User: trusted on every frontend key
    lc_alice = auth(k.lc, **{"X-DSS-User": "alice"})
    assert c.post("/v1/sessions", json={"session_id": "trip"}, headers=alice).status_code == 201
    assert c.post("/v1/sessions", json={"session_id": "work"}, headers=bob).status_code == 201
    assert c.post("/v1/sessions", json={"session_id": "trip"}, headers=lc_alice).status_code == 201
    assert session_ids(c, alice) == ["trip"]
    assert session_ids(c, bob) == ["work"]
    assert session_ids(c, lc_alice) == ["trip"]  # another frontend's alice: another person
    assert c.get("/v1/sessions/work", headers=alice).status_code == 404

    store = state_of(c).store
    tenants = {store.identity.tenant_for(UserId(u)) for u in ("webui/alice", "webui/bob", "lc/alice")}
    assert len(tenants) == 3
    assert store.versions.get_session(UserId("webui/alice"), SessionId("trip")).id == "trip"

    # The users each may list: a frontend its own end users, by their end-user ids; an admin all.
    assert [u["id"] for u in c.get("/v1/users", headers=auth(k.webui)).json()["data"]] == ["alice", "bob"]
    assert [u["id"] for u in c.get("/v1/users", headers=auth(k.lc)).json()["data"]] == ["alice"]
    everyone = c.get("/v1/users", headers=auth(k.admin)).json()["data"]
    assert [u["id"] for u in everyone] == ["lc/alice", "webui/alice", "webui/bob"]
    page = c.get("/v1/users", params={"limit": 1, "after": "alice"}, headers=auth(k.webui)).json()
    assert ([u["id"] for u in page["data"]], page["has_more"]) == (["bob"], False)
    assert error(c.get("/v1/users", headers=auth(k.carol)), 403)["type"] == "permission_error"


def test_a_request_naming_no_end_user_is_refused_saying_what_to_send(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    err = error(c.get("/v1/sessions", headers=auth(k.webui)), 400)
    assert (err["code"], err["param"]) == ("end_user_required", "user")
    assert "X-DSS-User" in err["message"] and WEBUI_USER in err["message"]
    err = error(c.post("/v1/sessions", json={}, headers=auth(k.lc)), 400)
    assert err["code"] == "end_user_required" and "X-DSS-User" in err["message"]
    # A blank header names nobody.
    assert error(c.get("/v1/sessions", headers=auth(k.webui, **{WEBUI_USER: " "})), 400)["code"] == (
        "end_user_required"
    )
    # Routes that act for no user answer without one (Open WebUI lists models without its headers).
    assert c.get("/v1/models", headers=auth(k.webui)).status_code == 200
    assert c.get("/v1/prefixes", headers=auth(k.webui)).status_code == 200
    assert c.get("/healthz").status_code == 200
    assert state_of(c).store.versions.list_sessions(UserId("webui"), limit=10)[0] == []


def test_two_sources_that_disagree_are_a_conflict(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    both = auth(k.webui, **{"X-DSS-User": "alice", WEBUI_USER: "bob"})
    err = error(c.post("/v1/sessions", json={"session_id": "s"}, headers=both), 400)
    assert (err["code"], err["param"]) == ("end_user_conflict", WEBUI_USER)
    assert "X-DSS-User" in err["message"] and WEBUI_USER in err["message"]
    same = auth(k.webui, **{"X-DSS-User": "alice", WEBUI_USER: "alice"})
    assert c.post("/v1/sessions", json={"session_id": "s"}, headers=same).status_code == 201
    assert c.get("/v1/users", headers=auth(k.webui)).json()["data"] == [{"object": "user", "id": "alice"}]


def test_an_end_user_off_the_id_rule_is_refused_naming_its_header(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    for bad in ("a/b", "x" * 300, "tab\there", "x" * 251):  # 251: `webui/` + 251 is over 256
        err = error(c.get("/v1/sessions", headers=auth(k.webui, **{WEBUI_USER: bad})), 400)
        assert err["code"] == "invalid_user_id" and WEBUI_USER in err["message"], bad


def test_a_user_key_ignores_a_forged_frontend_header(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    forged = auth(k.carol, **{WEBUI_USER: "alice", "X-DSS-User": "alice", WEBUI_CHAT: "chat-9"})
    r = c.post("/v1/sessions", json={"session_id": "mine"}, headers=forged)
    assert r.status_code == 201, r.text  # the chat-id header is not a user key's session header either
    assert session_ids(c, auth(k.carol)) == ["mine"]
    assert session_ids(c, auth(k.webui, **{WEBUI_USER: "alice"})) == []
    assert state_of(c).store.versions.list_sessions(UserId("carol"), limit=10)[0][0].id == "mine"


def test_a_frontend_erases_its_own_end_users_only(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    users = {
        "webui/alice": auth(k.webui, **{WEBUI_USER: "alice"}),
        "webui/bob": auth(k.webui, **{WEBUI_USER: "bob"}),
        "lc/alice": auth(k.lc, **{"X-DSS-User": "alice"}),
        "carol": auth(k.carol),
    }
    for h in users.values():
        assert c.post("/v1/sessions", json={"session_id": "s"}, headers=h).status_code == 201
    r = c.delete("/v1/users/alice", headers=auth(k.webui))
    assert r.status_code == 200, r.text
    receipt = r.json()
    assert receipt["counts"]["sessions"] == 1 and receipt["verification"]["remnants"] == 0
    assert [session_ids(c, h) for h in users.values()] == [[], ["s"], ["s"], ["s"]]
    # Verified as the end user, on the frontend's key; not by another frontend's alice.
    rid = receipt["id"]
    assert c.get(f"/v1/erasures/{rid}", headers=users["webui/alice"]).status_code == 200
    assert error(c.get(f"/v1/erasures/{rid}", headers=users["lc/alice"]), 404)["type"] == "not_found_error"
    assert error(c.get(f"/v1/erasures/{rid}", headers=auth(k.webui)), 400)["code"] == "end_user_required"
    # Another frontend's users and plain users are out of reach: a path id is an end-user id.
    assert error(c.delete("/v1/users/lc%2Falice", headers=auth(k.webui)), 400)["code"] == "invalid_user_id"
    assert session_ids(c, users["lc/alice"]) == ["s"]
    assert c.delete("/v1/users/carol", headers=auth(k.webui)).status_code == 200  # webui/carol: nobody
    assert session_ids(c, users["carol"]) == ["s"]
    assert [u["id"] for u in c.get("/v1/users", headers=auth(k.webui)).json()["data"]] == ["bob"]


def test_admin_operations_are_refused_to_a_frontend_key(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    h = auth(k.webui, **{WEBUI_USER: "alice"})
    answers = [
        c.get("/metrics", headers=h),
        c.post("/v1/prefixes", json={"text": "x" * 50}, headers=h),
        c.delete("/v1/prefixes/pfx_1", headers=h),
        c.get("/v1/erasures", headers=h),
        c.post("/v1/admin/keys", json={"user": "mallory"}, headers=h),
        c.get("/v1/admin/keys", headers=h),
        c.delete("/v1/admin/keys/key_1", headers=h),
        c.post("/v1/admin/frontends", json={"name": "evil"}, headers=h),
        c.get("/v1/admin/frontends", headers=h),
        c.patch("/v1/admin/frontends/webui", json={"user_headers": []}, headers=h),
        c.get("/v1/admin/audit", headers=h),
    ]
    assert [r.status_code for r in answers] == [403] * len(answers), [r.text for r in answers]


def test_keys_and_frontends_over_rest_are_audited(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    admin = auth(k.admin)
    admin_id = next(
        x["id"] for x in c.get("/v1/admin/keys", headers=admin).json()["data"] if x["kind"] == "admin"
    )

    r = c.post("/v1/admin/keys", json={"user": "dave"}, headers=admin)
    assert r.status_code == 201, r.text
    dave = r.json()
    assert (dave["kind"], dave["user"], dave["frontend"]) == ("user", "dave", None)
    assert c.post("/v1/sessions", json={"session_id": "d"}, headers=auth(dave["key"])).status_code == 201

    r = c.post("/v1/admin/keys", json={"frontend": "chatty"}, headers=admin)  # registers chatty
    assert r.status_code == 201, r.text
    chatty = r.json()
    assert (chatty["kind"], chatty["user"], chatty["frontend"]) == ("frontend", None, "chatty")
    listed = c.get("/v1/admin/keys", headers=admin).json()["data"]
    assert {x["id"] for x in listed} >= {dave["id"], chatty["id"]}
    assert all("key" not in x for x in listed)  # never a secret again
    assert {(x["kind"], x["frontend"]) for x in listed} >= {("frontend", "webui"), ("frontend", "lc")}

    # Frontends: create, refuse a second of a name, change the trusted headers.
    r = c.post("/v1/admin/frontends", json={"name": "owui", "user_headers": [WEBUI_USER]}, headers=admin)
    assert r.status_code == 201 and r.json()["created_by"] == admin_id, r.text
    assert error(c.post("/v1/admin/frontends", json={"name": "owui"}, headers=admin), 409)["code"] == (
        "frontend_exists"
    )
    names = [f["name"] for f in c.get("/v1/admin/frontends", headers=admin).json()["data"]]
    assert names == ["chatty", "lc", "owui", "webui"]
    r = c.patch("/v1/admin/frontends/webui", json={"user_headers": ["X-Person"]}, headers=admin)
    assert r.status_code == 200 and r.json()["user_headers"] == ["X-Person"]
    assert r.json()["session_header"] == WEBUI_CHAT  # left out: kept
    # The old header is trusted no more (this server forgets its cached keys at once).
    assert error(c.get("/v1/sessions", headers=auth(k.webui, **{WEBUI_USER: "alice"})), 400)["code"] == (
        "end_user_required"
    )
    assert c.get("/v1/sessions", headers=auth(k.webui, **{"X-Person": "alice"})).status_code == 200
    assert (
        error(c.patch("/v1/admin/frontends/nope", json={}, headers=admin), 404)["code"]
        == "frontend_not_found"
    )

    # Revoke: the key stops working; a second revoke, or an unknown id, is a 404.
    r = c.delete(f"/v1/admin/keys/{dave['id']}", headers=admin)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None, r.text
    assert c.get("/v1/sessions", headers=auth(dave["key"])).status_code == 401
    assert error(c.delete(f"/v1/admin/keys/{dave['id']}", headers=admin), 404)["code"] == "api_key_not_found"

    trail = c.get("/v1/admin/audit", headers=admin).json()["data"]
    by_admin = [(e["action"], e["subject"]) for e in trail if e["actor"] == admin_id]
    assert by_admin == [
        ("key.revoked", dave["id"]),
        ("frontend.changed", "webui"),
        ("frontend.created", "owui"),
        ("key.created", chatty["id"]),
        ("frontend.created", "chatty"),
        ("key.created", dave["id"]),
    ]
    changed = next(e for e in trail if e["action"] == "frontend.changed")
    assert changed["detail"]["before"]["user_headers"] == [WEBUI_USER]
    assert changed["detail"]["after"]["user_headers"] == ["X-Person"]
    by_cli = {(e["action"], e["detail"].get("kind")) for e in trail if e["actor"] == "cli"}
    assert by_cli == {("key.created", "admin"), ("key.created", "user"), ("key.created", "frontend"),
                      ("frontend.created", None)}  # fmt: skip
    page = c.get("/v1/admin/audit", params={"limit": 2}, headers=admin).json()
    assert len(page["data"]) == 2 and page["has_more"]
    older = c.get("/v1/admin/audit", params={"before": page["data"][-1]["id"]}, headers=admin).json()
    assert older["data"][0]["id"] == trail[2]["id"]


BAD_KEYS: list[dict[str, Any]] = [
    {"user": "x", "admin": True},
    {},
    {"frontend": "a/b"},
    {"user": "admin"},
    {"user": "a/b"},
]
BAD_FRONTENDS: list[dict[str, Any]] = [
    {"name": "x", "user_headers": ["Authorization"]},
    {"name": "x", "user_headers": ["X-DSS-User"]},
    {"name": "x", "user_headers": ["not a header"]},
    {"name": "x", "user_headers": ["X-A", "x-a"]},
    {"name": "x", "user_headers": ["X-A"], "session_header": "X-A"},
    {"name": "x", "session_header": "X-Session-ID"},
    {"name": "x" * 65},
]


def test_bad_key_and_frontend_requests_are_400s(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    for path, bodies in (("/v1/admin/keys", BAD_KEYS), ("/v1/admin/frontends", BAD_FRONTENDS)):
        for body in bodies:
            err = error(c.post(path, json=body, headers=auth(k.admin)), 400)
            assert err["type"] == "invalid_request_error", (path, body)
    for params in ({"before": 2**40}, {"before": 0}, {"limit": 0}):  # past PostgreSQL's integer: a 400
        assert error(c.get("/v1/admin/audit", params=params, headers=auth(k.admin)), 400)["code"] == (
            "invalid_request"
        )
    assert c.get("/v1/admin/frontends", headers=auth(k.admin)).json()["data"][0]["name"] == "lc"
    assert len(c.get("/v1/admin/frontends", headers=auth(k.admin)).json()["data"]) == 2


def test_a_frontend_is_not_registered_under_a_name_stored_users_hold(server: tuple[TestClient, Keys]) -> None:
    """An older version allowed `/` in user ids: a frontend `org` would act as `org/alice`."""
    c, k = server
    state_of(c).store.versions.create_session(UserId("org/alice"), SessionId("old"))
    err = error(c.post("/v1/admin/frontends", json={"name": "org"}, headers=auth(k.admin)), 409)
    assert err["code"] == "frontend_name_taken" and "org/" in err["message"]
    assert error(c.post("/v1/admin/keys", json={"frontend": "org"}, headers=auth(k.admin)), 409)["code"] == (
        "frontend_name_taken"
    )
    assert c.post("/v1/admin/frontends", json={"name": "org2"}, headers=auth(k.admin)).status_code == 201


# --------------------------------------------------------------------------------- session headers
def test_vllms_session_header_names_the_session(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    r = c.post("/v1/sessions", json={}, headers=auth(k.carol, **{"X-Session-ID": "vllm-1"}))
    assert r.status_code == 201 and r.json()["id"] == "vllm-1", r.text
    same = auth(k.carol, **{"X-Session-ID": "vllm-2", "X-DSS-Session": "vllm-2"})
    assert c.post("/v1/sessions", json={"session_id": "vllm-2"}, headers=same).json()["id"] == "vllm-2"
    for headers, body in [
        ({"X-Session-ID": "a", "X-DSS-Session": "b"}, {}),
        ({"X-Session-ID": "a"}, {"session_id": "b"}),
    ]:
        err = error(c.post("/v1/sessions", json=body, headers=auth(k.carol, **headers)), 400)
        assert err["code"] == "session_id_conflict" and "X-Session-ID" in err["message"]
    err = error(c.post("/v1/sessions", json={}, headers=auth(k.carol, **{"X-Session-ID": "a b"})), 400)
    assert (err["code"], err["param"]) == ("invalid_request", "X-Session-ID")
    assert session_ids(c, auth(k.carol)) == ["vllm-1", "vllm-2"]


def test_a_frontends_session_header_names_the_session(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    alice = auth(k.webui, **{WEBUI_USER: "alice", WEBUI_CHAT: "chat-1"})
    r = c.post("/v1/sessions", json={}, headers=alice)
    assert r.status_code == 201 and r.json()["id"] == "chat-1", r.text
    err = error(c.post("/v1/sessions", json={"session_id": "other"}, headers=alice), 400)
    assert err["code"] == "session_id_conflict" and WEBUI_CHAT in err["message"]
    err = error(c.post("/v1/sessions", json={}, headers={**alice, WEBUI_CHAT: "../x"}), 400)
    assert (err["code"], err["param"]) == ("invalid_request", WEBUI_CHAT)
    # Another frontend's key does not read webui's chat header.
    lc = auth(k.lc, **{"X-DSS-User": "alice", WEBUI_CHAT: "chat-1"})
    assert c.post("/v1/sessions", json={"session_id": "own"}, headers=lc).json()["id"] == "own"


# ------------------------------------------------------------------------------------------- CLI
def test_cli_creates_frontend_keys_and_lists_them(tmp_path: Path) -> None:
    runner = CliRunner()
    data = str(tmp_path)
    key = cli_key(
        tmp_path, "--frontend", "webui", "--user-header", WEBUI_USER, "--session-header", WEBUI_CHAT
    )
    second = cli_key(tmp_path, "--frontend", "webui")  # the frontend exists: its headers stay
    listing = runner.invoke(cli, ["keys", "list", "--data-dir", data]).stdout
    assert listing.count("frontend:webui\tfrontend\tactive") == 2 and key not in listing
    assert f"frontend\twebui\tuser headers: {WEBUI_USER}\tsession header: {WEBUI_CHAT}" in listing
    for bad in (
        ["--frontend", "webui", "--user", "alice"],
        ["--user", "alice", "--user-header", WEBUI_USER],
        ["--frontend", "a/b"],
        ["--frontend", "x", "--user-header", "Authorization"],
    ):
        res = runner.invoke(cli, ["keys", "create", *bad, "--data-dir", data])
        assert res.exit_code == 2, (bad, res.output)
    engine = make_engine(f"sqlite:///{tmp_path}/dss.sqlite3")
    try:
        caller = ApiKeys(make_session_factory(engine)).authenticate(second)
        assert caller is not None and caller.user is None and caller.frontend is not None
        assert (caller.frontend.name, caller.frontend.user_headers) == ("webui", (WEBUI_USER,))
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------------- migration
def test_the_migration_keeps_older_keys_as_they_were(db_url: str) -> None:
    from alembic import command

    from dss.db.connect import alembic_config

    command.upgrade(alembic_config(db_url), "0008")
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            insert = (
                "INSERT INTO api_keys (id, key_hash, user_id, is_admin) VALUES ('key_old', :h, 'ann', false)"
            )
            conn.execute(text(insert), {"h": "0" * 64})
        upgrade_to_head(db_url)
        assert current_revision(db_url) == HEAD_REVISION
        keys = ApiKeys(make_session_factory(engine))
        (old,) = keys.list()
        assert (old.id, old.user, old.kind, old.frontend) == ("key_old", "ann", "user", None)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM frontends")).scalar_one() == 0
            assert conn.execute(text("SELECT count(*) FROM admin_audit")).scalar_one() == 0
        command.downgrade(alembic_config(db_url), "0008")
        assert current_revision(db_url) == "0008"
    finally:
        engine.dispose()


def test_cli_sets_a_frontends_lead_updates_once_checked(tmp_path: Path) -> None:
    runner = CliRunner()
    data = str(tmp_path)
    pattern = r"\bAnn\b"
    key = cli_key(tmp_path, "--frontend", "owui", "--lead-updates", "volatile", "--volatile-pattern", pattern)
    listing = runner.invoke(cli, ["keys", "list", "--data-dir", data]).stdout
    assert "frontend\towui\tuser headers: -\tsession header: -\tlead updates: volatile" in listing
    for bad in (
        ["--lead-updates", "sometimes"],
        ["--volatile-pattern", "\x28"],
        ["--volatile-pattern", "x*"],
    ):
        res = runner.invoke(cli, ["keys", "create", "--frontend", "owui2", *bad, "--data-dir", data])
        assert res.exit_code == 2, (bad, res.output)
        listed = runner.invoke(cli, ["keys", "list", "--data-dir", data]).stdout
        assert "owui2" not in listed  # refused whole: no frontend half-made
    cli_key(tmp_path, "--frontend", "owui", "--lead-updates", "off")  # an existing frontend: changed
    engine = make_engine(f"sqlite:///{tmp_path}/dss.sqlite3")
    try:
        sf = make_session_factory(engine)
        caller = ApiKeys(sf).authenticate(key)
        assert caller is not None and caller.frontend is not None
        assert (caller.frontend.lead_updates, caller.frontend.volatile_patterns) == ("off", (pattern,))
        changes = [e for e in AuditTrail(sf).list(limit=20)[0] if e.action == "frontend.changed"]
        assert changes and changes[0].detail["after"]["lead_updates"] == "off"
    finally:
        engine.dispose()
