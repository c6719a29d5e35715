"""Who a request acts for, without the engine (issue 28): identity and session headers read once
and as UTF-8, ids that clients cannot put in a URL, and each frontend's trusted identity sources.

The routes whose body names the end user (chat, messages, Responses) need the engine; their
identity step is `api.deps.acting_principal`, called here on a real request's headers and a
caller authenticated by the real key table (`tests/api/keys/test_frontend_turns.py` drives the
routes themselves with an engine)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text
from starlette.requests import Request
from typer.testing import CliRunner

from api.app import create_app
from api.auth import Caller
from api.cli import main as cli
from api.deps import acting_principal
from api.http_errors import ApiError, EndUserSourceNotTrusted
from api.keys.frontends import Frontends
from dss.db.connect import current_revision, make_engine, make_session_factory, upgrade_to_head
from dss.types import SessionId, UserId
from tests.api.keys.test_frontends import WEBUI_CHAT, WEBUI_USER, Keys, auth, cli_key, error, session_ids
from tests.api.test_unit import DEV, settings_for, started, state_of
from tests.db_helpers import HEAD_REVISION

Raw = list[tuple[str, str | bytes]]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[TestClient, Keys]]:
    data = tmp_path / "data"
    keys = Keys(data)
    with TestClient(create_app(settings_for(data))) as c:
        yield started(c, timeout_s=180), keys


def raw(key: str, *headers: tuple[str, str | bytes]) -> Raw:
    """Headers as lines (a name may repeat; a value may be bytes, sent as they are)."""
    return [("Authorization", f"Bearer {key}"), *headers]


def caller_of(c: TestClient, key: str) -> Caller:
    found = state_of(c).keys.authenticate(key)
    assert found is not None
    return found


def send_bytes(c: TestClient, path: str, headers: list[tuple[str, bytes]]) -> tuple[int, dict[str, Any]]:
    """A GET whose header values reach the app as these bytes (the test client's transport
    re-encodes every value as UTF-8, so it cannot send other bytes)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), *((n.lower().encode(), v) for n, v in headers)],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def call() -> None:
        await c.app(scope, receive, send)

    assert c.portal is not None
    c.portal.call(call)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body)


def request_with(*headers: tuple[str, bytes]) -> Request:
    """A request as the ASGI server hands it over: header names and values as bytes."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "headers": [(n.lower().encode(), v) for n, v in headers],
    }
    return Request(scope)


# ------------------------------------------------------------------------------ repeated headers
@pytest.mark.parametrize(
    "header",
    ["X-DSS-User", WEBUI_USER],
)
def test_a_repeated_identity_header_is_refused_naming_it(
    server: tuple[TestClient, Keys], header: str
) -> None:
    """Behind a proxy that appends its own line, the client's line comes first: it used to win."""
    c, k = server
    for lines in (
        [(header, "mallory"), (header, "alice")],  # two lines: the client's, the proxy's
        [(header, "mallory, alice")],  # the same folded into one line by a proxy
    ):
        r = c.get("/v1/sessions", headers=raw(k.webui, *lines))
        err = error(r, 400)
        assert (err["code"], err["param"]) == ("repeated_header", header), err
    assert c.get("/v1/users", headers=auth(k.webui)).json()["data"] == []  # nobody was made


def test_a_repeated_session_header_is_refused_naming_it(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    alice = (WEBUI_USER, "alice")
    for header in ("X-DSS-Session", "X-Session-ID", WEBUI_CHAT):
        lines = [alice, (header, "chat-1"), (header, "chat-2")]
        err = error(c.post("/v1/sessions", json={}, headers=raw(k.webui, *lines)), 400)
        assert (err["code"], err["param"]) == ("repeated_header", header), err
    assert session_ids(c, auth(k.webui, **{WEBUI_USER: "alice"})) == []


def test_development_modes_user_header_is_read_once(tmp_path: Path) -> None:
    with TestClient(create_app(settings_for(tmp_path, auth=DEV))) as c:
        started(c)
        lines = [("X-DSS-User", "mallory"), ("X-DSS-User", "alice")]
        err = error(c.get("/v1/sessions", headers=lines), 400)
        assert (err["code"], err["param"]) == ("repeated_header", "X-DSS-User")


# ---------------------------------------------------------------------------- non-ASCII end users
def test_a_non_ascii_end_user_is_one_person_by_header_body_and_path(server: tuple[TestClient, Keys]) -> None:
    """`X-DSS-User: josé` (UTF-8 bytes) used to be `webui/josÃ©`, whom `DELETE /v1/users/jos%C3%A9`
    never reached: it answered 200 with an empty receipt and the data stayed."""
    c, k = server
    for header in ("X-DSS-User", WEBUI_USER):
        r = c.post(
            "/v1/sessions", json={}, headers=raw(k.webui, (header, "josé".encode()), (WEBUI_CHAT, header))
        )
        assert r.status_code == 201, r.text
    assert [u["id"] for u in c.get("/v1/users", headers=auth(k.webui)).json()["data"]] == ["josé"]
    store = state_of(c).store
    assert store.versions.get_session(UserId("webui/josé"), SessionId(WEBUI_USER)).id == WEBUI_USER

    # The body's `user` (chat, messages, Responses) names the same DSS user.
    by_body = acting_principal(request_with(), caller_of(c, k.webui), "josé")
    by_header = acting_principal(request_with(("X-DSS-User", "josé".encode())), caller_of(c, k.webui), "josé")
    assert by_body.user == by_header.user == "webui/josé"

    r = c.delete("/v1/users/jos%C3%A9", headers=auth(k.webui))
    assert r.status_code == 200, r.text
    assert r.json()["counts"]["sessions"] == 2 and r.json()["verification"]["remnants"] == 0
    assert c.get("/v1/users", headers=auth(k.webui)).json()["data"] == []


def test_a_header_that_is_not_utf8_is_refused_naming_it(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    for header in ("X-DSS-User", WEBUI_USER):
        lines = [("Authorization", f"Bearer {k.webui}".encode()), (header, "josé".encode("latin-1"))]
        status, body = send_bytes(c, "/v1/sessions", lines)
        assert (status, body["error"]["code"], body["error"]["param"]) == (
            400,
            "invalid_header_encoding",
            header,
        )
    with pytest.raises(ApiError) as caught:
        acting_principal(request_with(("X-DSS-User", b"\xff")), caller_of(c, k.webui), None)
    assert caught.value.code == "invalid_header_encoding"


# ------------------------------------------------------------------------------------ `.` and `..`
DOTS = (".", "..")


def test_dot_segments_are_refused_as_new_user_ids_and_frontend_names(server: tuple[TestClient, Keys]) -> None:
    """A client removes `.` and `..` from a URL (even as `%2E%2E`): such a user could not be erased."""
    c, k = server
    admin = auth(k.admin)
    for dots in DOTS:
        for path, body in (
            ("/v1/admin/keys", {"user": dots}),
            ("/v1/admin/keys", {"frontend": dots}),
            ("/v1/admin/frontends", {"name": dots}),
        ):
            assert error(c.post(path, json=body, headers=admin), 400)["code"] == "invalid_user_id", (
                path,
                body,
            )
        for header in ("X-DSS-User", WEBUI_USER):
            err = error(c.get("/v1/sessions", headers=auth(k.webui, **{header: dots})), 400)
            assert err["code"] == "invalid_user_id" and header in err["message"], err
    res = CliRunner().invoke(
        cli, ["keys", "create", "--user", "..", "--data-dir", str(state_of(c).settings.store.data_dir)]
    )
    assert res.exit_code == 2, res.output
    assert c.get("/v1/users", headers=admin).json()["data"] == []


def test_dot_segment_users_made_before_the_rule_are_erased_by_a_query_id(
    server: tuple[TestClient, Keys],
) -> None:
    c, k = server
    store = state_of(c).store
    for user in ("..", ".", "webui/.."):
        store.versions.create_session(UserId(user), SessionId("old"))
    # What a client makes of the path form: `/v1/users/..` is `/v1/`, `%2E%2E` alike.
    assert c.delete("/v1/users/..", headers=auth(k.admin)).status_code == 404
    r = c.delete("/v1/users", params={"id": ".."}, headers=auth(k.admin))
    assert r.status_code == 200 and r.json()["counts"]["sessions"] == 1, r.text
    assert r.json()["verification"]["remnants"] == 0
    # A frontend key names its own end user `..`; its `.` was never stored: refused, not a receipt.
    r = c.delete("/v1/users", params={"id": ".."}, headers=auth(k.webui))
    assert r.status_code == 200 and r.json()["counts"]["sessions"] == 1, r.text
    assert error(c.delete("/v1/users", params={"id": "."}, headers=auth(k.webui)), 400)["code"] == (
        "invalid_user_id"
    )
    assert [u["id"] for u in c.get("/v1/users", headers=auth(k.admin)).json()["data"]] == ["."]
    # The query form is the path form otherwise: a user key erases itself only.
    assert error(c.delete("/v1/users", params={"id": "."}, headers=auth(k.carol)), 403)["type"] == (
        "permission_error"
    )
    assert c.delete("/v1/users", params={"id": "."}, headers=auth(k.admin)).status_code == 200
    assert c.get("/v1/users", headers=auth(k.admin)).json()["data"] == []


# ---------------------------------------------------------------------------- trusted sources
def test_a_frontend_with_body_identities_off_refuses_a_body_user(server: tuple[TestClient, Keys]) -> None:
    """A frontend that forwards its end users' extra body parameters (LibreChat's
    `addParams`, a proxy passing the body through) let any of them name anyone in `user`."""
    c, k = server
    data = state_of(c).settings.store.data_dir
    key = cli_key(data, "--frontend", "strict", "--user-header", "X-Person", "--no-trust-body-user")
    caller = caller_of(c, key)
    assert caller.frontend is not None and not caller.frontend.trust_body_user
    mallory = request_with(("X-Person", b"mallory"))
    for field, args in (("user", ("alice", None)), ("safety_identifier", (None, "alice"))):
        with pytest.raises(EndUserSourceNotTrusted) as caught:
            acting_principal(mallory, caller, *args)
        assert caught.value.param == field and "X-Person" in caught.value.message
    # The same person in the body is refused too: the field is not ignored, it is not trusted.
    with pytest.raises(EndUserSourceNotTrusted):
        acting_principal(mallory, caller, "mallory")
    assert acting_principal(mallory, caller, None).user == "strict/mallory"
    # Frontends made before keep trusting the body, as they did.
    assert acting_principal(request_with(), caller_of(c, k.webui), "alice").user == "webui/alice"
    listing = CliRunner().invoke(cli, ["keys", "list", "--data-dir", str(data)]).stdout
    assert "frontend\tstrict\tuser headers: X-Person" in listing and "body user: refused" in listing


def test_a_frontends_trusted_sources_are_set_over_rest(server: tuple[TestClient, Keys]) -> None:
    c, k = server
    admin = auth(k.admin)
    got = c.get("/v1/admin/frontends", headers=admin).json()["data"]
    assert {(f["name"], f["trust_dss_user_header"], f["trust_body_user"]) for f in got} == {
        ("lc", True, True),
        ("webui", True, True),
    }
    r = c.patch("/v1/admin/frontends/webui", json={"trust_dss_user_header": False}, headers=admin)
    assert r.status_code == 200 and (r.json()["trust_dss_user_header"], r.json()["trust_body_user"]) == (
        False,
        True,
    ), r.text
    # X-DSS-User on webui's key: refused, naming it (even alongside its own header, same person).
    for headers in ({"X-DSS-User": "alice"}, {"X-DSS-User": "alice", WEBUI_USER: "alice"}):
        err = error(c.get("/v1/sessions", headers=auth(k.webui, **headers)), 400)
        assert (err["code"], err["param"]) == ("end_user_source_not_trusted", "X-DSS-User"), err
    assert c.get("/v1/sessions", headers=auth(k.webui, **{WEBUI_USER: "alice"})).status_code == 200
    err = error(c.get("/v1/sessions", headers=auth(k.webui)), 400)
    assert err["code"] == "end_user_required" and "X-DSS-User" not in err["message"], err
    # A frontend whose keys could name nobody is refused when it is set up, not per request.
    bad = {"name": "mute", "trust_dss_user_header": False, "trust_body_user": False}
    assert (
        error(c.post("/v1/admin/frontends", json=bad, headers=admin), 400)["type"] == "invalid_request_error"
    )
    r = c.post("/v1/admin/frontends", json={**bad, "user_headers": ["X-Person"]}, headers=admin)
    assert r.status_code == 201 and r.json()["trust_body_user"] is False, r.text
    lone = {"user_headers": []}
    assert error(c.patch("/v1/admin/frontends/mute", json=lone, headers=admin), 400)["type"] == (
        "invalid_request_error"
    )
    trail = c.get("/v1/admin/audit", headers=admin).json()["data"]
    changed = next(e for e in trail if e["action"] == "frontend.changed" and e["subject"] == "webui")
    assert (
        changed["detail"]["before"]["trust_dss_user_header"],
        changed["detail"]["after"]["trust_dss_user_header"],
    ) == (True, False)


def test_the_migration_keeps_existing_frontends_trusting_what_they_did(db_url: str) -> None:
    from alembic import command

    from dss.db.connect import alembic_config

    command.upgrade(alembic_config(db_url), "0010_lead_updates")
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO frontends (name, user_headers, created_by) VALUES ('old', '[]', 'cli')")
            )
        upgrade_to_head(db_url)
        assert current_revision(db_url) == HEAD_REVISION == "0015_version_bytes_index"
        old = Frontends(make_session_factory(engine)).get("old")
        assert (old.trust_dss_user_header, old.trust_body_user) == (True, True)
        command.downgrade(alembic_config(db_url), "0010_lead_updates")
        assert current_revision(db_url) == "0010_lead_updates"
    finally:
        engine.dispose()
