"""Erasing ids that hold nothing (issue 28, item 5), without the engine: such an erasure answers
`held_nothing: true` and writes no receipt, and a key's erasures are rate-limited per key as well
as per end user. And an erasure pseudonymises the user's id in the admin audit trail (item 7).

Before the fix every erasure of a never-seen id appended a permanent receipt to the chain, and a
frontend key could erase arbitrary ids at full speed (the only bucket was the end user's).
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from api.app import create_app
from dss.db.connect import transaction
from dss.db.models import AdminAuditRow, ErasureReceiptRow
from dss.store import Store
from tests.api.keys.test_frontends import WEBUI_USER, auth, cli_key
from tests.api.test_unit import settings_for, started, state_of


def _receipts(store: Store) -> int:
    with transaction(store.sf) as db:
        return int(db.scalar(select(func.count()).select_from(ErasureReceiptRow)) or 0)


def test_erasing_an_id_that_holds_nothing_says_so_and_writes_no_receipt(tmp_path: Path) -> None:
    data = tmp_path / "data"
    admin, webui = cli_key(data, "--admin"), cli_key(data, "--frontend", "webui", "--user-header", WEBUI_USER)
    with TestClient(create_app(settings_for(data))) as c:
        store = state_of(started(c, timeout_s=180)).store
        for who, path in ((webui, "/v1/users/never-seen"), (admin, "/v1/users/nobody")):
            r = c.delete(path, headers=auth(who))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["held_nothing"] is True and body["object"] == "erasure.nothing_held", body
            assert "id" not in body
        assert _receipts(store) == 0
        assert c.get("/v1/erasures", headers=auth(admin)).json()["data"] == []
        # An id that holds something is erased with its receipt, as before.
        alice = auth(webui, **{WEBUI_USER: "alice"})
        assert c.post("/v1/sessions", json={"session_id": "s"}, headers=alice).status_code == 201
        r = c.delete("/v1/users/alice", headers=auth(webui))
        assert r.status_code == 200, r.text
        receipt = r.json()
        assert receipt["held_nothing"] is False and receipt["counts"]["sessions"] == 1
        assert receipt["verification"]["remnants"] == 0
        assert _receipts(store) == 1
        # Erased again, alice holds nothing: no second receipt; and she can start afresh.
        assert c.delete("/v1/users/alice", headers=auth(webui)).json()["held_nothing"] is True
        assert _receipts(store) == 1
        assert c.post("/v1/sessions", json={"session_id": "s"}, headers=alice).status_code == 201


def test_a_keys_erasures_are_rate_limited_per_key(tmp_path: Path) -> None:
    data = tmp_path / "data"
    webui, other = cli_key(data, "--frontend", "webui"), cli_key(data, "--frontend", "lc")
    admin = cli_key(data, "--admin")
    limits = {"erasures_per_key_per_minute": 1.0, "erasures_per_key_burst": 3}
    with TestClient(create_app(settings_for(data, limits=limits))) as c:
        started(c, timeout_s=180)
        # Three end users, each with a full bucket of their own: the key's bucket is what runs out.
        for user in ("u1", "u2", "u3"):
            assert c.delete(f"/v1/users/{user}", headers=auth(webui)).status_code == 200
        r = c.delete("/v1/users/u4", headers=auth(webui))
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limited"
        assert 1 <= int(r.headers["retry-after"]) <= 60
        # Another key has a bucket of its own; admin keys are not limited.
        assert c.delete("/v1/users/u4", headers=auth(other)).status_code == 200
        for user in ("a1", "a2", "a3", "a4", "a5"):
            assert c.delete(f"/v1/users/{user}", headers=auth(admin)).status_code == 200


def test_an_erased_user_is_named_by_a_pseudonym_in_the_audit_trail(tmp_path: Path) -> None:
    """Issue 28, item 7: the admin audit trail kept the id of every user a key was created for,
    past the user's erasure. The erasure's transaction now names them by the erased tenant."""
    data = tmp_path / "data"
    admin = cli_key(data, "--admin")
    cli_key(data, "--user", "zoe-audited")  # audited as `key.created` for the user
    with TestClient(create_app(settings_for(data))) as c:
        started(c, timeout_s=180)
        r = c.post("/v1/admin/keys", json={"user": "zoe-audited"}, headers=auth(admin))  # and over REST
        assert r.status_code == 201, r.text
        zoe = auth(r.json()["key"])
        assert c.post("/v1/sessions", json={"session_id": "s"}, headers=zoe).status_code == 201
        before = c.get("/v1/admin/audit", headers=auth(admin)).json()["data"]
        assert sum("zoe-audited" in json.dumps(e) for e in before) == 2
        r = c.delete("/v1/users/zoe-audited", headers=auth(admin))
        assert r.status_code == 200, r.text
        receipt = r.json()
        after = c.get("/v1/admin/audit", headers=auth(admin)).json()["data"]
        assert len(after) == len(before)  # entries are pseudonymised, not deleted
        assert not any("zoe-audited" in json.dumps(e) for e in after), after
        assert receipt["counts"]["audit_entries"] == 2
        named = [e for e in after if e["detail"].get("user") == f"erased:{receipt['subject']}"]
        assert len(named) == 2 and {e["action"] for e in named} == {"key.created"}
        # A user who held nothing but an audit entry is erased with a receipt (it held that).
        cli_key(data, "--user", "yan-audited")
        r = c.delete("/v1/users/yan-audited", headers=auth(admin))
        assert r.json()["held_nothing"] is False and r.json()["counts"]["audit_entries"] == 1
        with transaction(state_of(c).store.sf) as db:
            details = [json.dumps(d) for d in db.scalars(select(AdminAuditRow.detail))]
        assert not any("-audited" in d for d in details), details
