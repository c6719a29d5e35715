"""One shape across the API, as the docs describe it (no engine): lists name their first and last
item, times are ISO strings everywhere, a conflict has a specific code, the engine's 503s carry
the documented Retry-After, the limits table lists every limit, and the Alembic environment reads
the server's own database variable."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from api.http_errors import response_for
from api.settings import LimitsSettings
from api.state import AppState
from dss import errors as e
from dss.dialogue.turns import chat_target
from dss.dialogue.versions import VersionStore
from tests.api.test_unit import DEV, settings_for, started
from tests.paths import REPO
from tests.store_helpers import SMALL_FP

ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|\+00:00)$")


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = settings_for(tmp_path / "data", auth=DEV, engine={"enabled": False, "retry_after_s": 7})
    with TestClient(create_app(settings)) as c:
        yield started(c)


def _state(c: TestClient) -> AppState:
    state: AppState = c.app.state.dss  # type: ignore[attr-defined]
    return state


ALICE = {"X-DSS-User": "alice"}


def test_every_list_names_its_first_and_last_item(client: TestClient) -> None:
    """`first_id`/`last_id` are documented on every list; the versions list returned null."""
    store = _state(client).store
    for sid in ("a", "b"):
        assert client.post("/v1/sessions", json={"session_id": sid}, headers=ALICE).status_code == 201
    for i in range(3):
        msgs = [{"role": "user", "content": f"turn {i}"}]
        store.versions.commit("alice", "a", tokens=np.arange(8 + i, dtype=np.int32), messages=msgs)
    assert client.post(
        "/v1/sessions/a/branches", json={"from_version": 2, "name": "side"}, headers=ALICE
    ).is_success
    fid = store.fingerprints.register(SMALL_FP)
    store.prefixes.register(fid, np.arange(1, 9, dtype=np.int32))

    def ends(path: str) -> tuple[str | None, str | None]:
        body = client.get(path, headers=ALICE).json()
        return body["first_id"], body["last_id"]

    assert ends("/v1/sessions") == ("a", "b")
    assert ends("/v1/sessions/a/versions") == ("1", "3")
    assert ends("/v1/sessions/a/branches") == ("main", "side")
    prefix = client.get("/v1/prefixes", headers=ALICE).json()["data"][0]["id"]
    assert ends("/v1/prefixes") == (prefix, prefix)
    assert ends("/v1/sessions/b/versions") == (None, None)  # an empty list names nothing


def test_times_are_iso_strings_on_every_object(client: TestClient) -> None:
    """A prefix's `created_at` was a Unix integer while sessions, branches, versions and receipts
    said ISO 8601; now every `created_at` is an ISO string in UTC."""
    store = _state(client).store
    client.post("/v1/sessions", json={"session_id": "t"}, headers=ALICE)
    store.versions.commit("alice", "t", tokens=np.arange(8, dtype=np.int32), messages=[{"role": "user"}])
    fid = store.fingerprints.register(SMALL_FP)
    store.prefixes.register(fid, np.arange(1, 9, dtype=np.int32))
    times = {
        "session": client.get("/v1/sessions/t", headers=ALICE).json()["created_at"],
        "branch": client.get("/v1/sessions/t/branches", headers=ALICE).json()["data"][0]["created_at"],
        "version": client.get("/v1/sessions/t/versions", headers=ALICE).json()["data"][0]["created_at"],
        "prefix": client.get("/v1/prefixes", headers=ALICE).json()["data"][0]["created_at"],
    }
    for kind, value in times.items():
        assert isinstance(value, str) and ISO_UTC.match(value), (kind, value)
    stamps = {k: datetime.fromisoformat(v.replace("Z", "+00:00")) for k, v in times.items()}
    assert max(stamps.values()) - min(stamps.values()) < timedelta(minutes=1)  # one clock, one zone
    schema = client.get("/openapi.json").json()["components"]["schemas"]["PrefixOut"]["properties"]
    assert schema["created_at"] == {"type": "string", "format": "date-time", "title": "Created At"}


def test_a_stale_state_version_has_its_own_code(session_factory: sessionmaker[Session]) -> None:
    """The 409 for messages that do not extend `state_version` said `conflict_error`, the type,
    where every other error names itself."""
    versions = VersionStore(session_factory)
    versions.create_session("alice", "s")
    first = [{"role": "user", "content": "hi"}]
    versions.commit("alice", "s", tokens=np.arange(8, dtype=np.int32), messages=first)
    other = [{"role": "user", "content": "something else"}, {"role": "user", "content": "more"}]
    with pytest.raises(e.StateVersionMismatch) as caught:
        chat_target(versions, "alice", "s", other, state_version=1)
    resp = response_for(caught.value)
    body = bytes(resp.body).decode()
    assert resp.status_code == 409
    assert '"type":"conflict_error"' in body and '"code":"state_version_mismatch"' in body


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (e.StateVersionMismatch("x"), "state_version_mismatch"),
        (e.ForkNamesExhausted("x"), "fork_names_exhausted"),
        (e.StaleHead("x"), "stale_head"),
        (e.NotAnAncestor("x"), "not_an_ancestor"),
        (e.BranchExists("x"), "branch_exists"),
        (e.SessionExists("x"), "session_exists"),
        (e.PinnedCapExceeded("x"), "pinned_cap_exceeded"),
    ],
)
def test_conflicts_name_themselves(exc: e.DSSError, code: str) -> None:
    resp = response_for(exc)
    assert resp.status_code == 409 and f'"code":"{code}"' in bytes(resp.body).decode()


def test_no_conflict_is_raised_without_a_specific_class() -> None:
    """A bare `ConflictError(...)` would answer `code: conflict_error` again."""
    bare = re.compile(r"raise\s+(e\.|errors\.)?ConflictError\(")
    offenders = [
        f"{p.relative_to(REPO)}:{n}"
        for root in ("dss", "api")
        for p in sorted((REPO / root).rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if bare.search(line)
    ]
    assert offenders == []


def test_engine_503s_carry_the_documented_retry_after(client: TestClient) -> None:
    """`engine.retry_after_s` (DSS_ENGINE__RETRY_AFTER_S) is documented as the Retry-After of the
    engine's 503s; while the engine was starting (or disabled) the server sent a fixed 5."""
    r = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, headers=ALICE
    )
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    assert r.headers["retry-after"] == "7"
    ops = (REPO / "docs" / "operations.md").read_text()
    row = next(line for line in ops.splitlines() if line.startswith("| `DSS_ENGINE__RETRY_AFTER_S`"))
    assert "engine_unavailable" in row and "engine_overloaded" in row


def test_the_limits_table_lists_every_limit() -> None:
    api = (REPO / "docs" / "api.md").read_text()
    section = api[api.index("## Limits") :]
    section = section[: section.find("\n## ", 4)]
    documented = set(re.findall(r"^\| `limits\.(\w+)` \| ([^|]+) \|", section, re.M))
    defaults = LimitsSettings()
    fields = {name for name in LimitsSettings.model_fields}
    assert {name for name, _ in documented} == fields
    for name, default in documented:
        value = getattr(defaults, name)
        shown = default.strip()
        forms = (
            (str(value), f"{value >> 20} Mi", f"{value >> 20} MiB")
            if isinstance(value, int)
            else (str(value),)
        )
        assert shown in forms, (name, shown, value)


def test_alembic_reads_the_servers_database_variable(tmp_path: Path) -> None:
    """The server reads `DSS_STORE__DB_URL`; `alembic upgrade head` read `DSS_DB_URL`, so the
    documented command did nothing but fail."""
    url = f"sqlite:///{tmp_path / 'dss.sqlite3'}"
    env = {k: v for k, v in os.environ.items() if k != "DSS_DB_URL"}
    env["DSS_STORE__DB_URL"] = url
    alembic = Path(sys.executable).with_name("alembic")
    done = subprocess.run(
        [str(alembic), "upgrade", "head"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    tables = set(sa.inspect(sa.create_engine(url)).get_table_names())
    assert {"sessions", "versions", "alembic_version"} <= tables
    ops = (REPO / "docs" / "operations.md").read_text()
    assert "DSS_STORE__DB_URL=... .venv/bin/alembic upgrade head" in ops and "DSS_DB_URL" not in ops
