"""The master key stays out of the server's child processes (issue 28, suspicion: "DSS_MASTER_KEY
stays in the API process environment"), without the engine: a server started with the key in
`DSS_MASTER_KEY` takes it out of its environment once the store has read it, so a process it
starts afterwards (vLLM's engine core and workers, which it spawns after the store is open; the
page codec's helper) does not inherit it.

Before the fix the variable stayed in `os.environ` for the server's life, and every child
process, engine workers included, held the master key in its environment."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from dss.pages.encoder import _Worker
from tests.api.test_unit import DEV, as_user, settings_for, started

ENV = "DSS_MASTER_KEY"


def _report(conn: Connection) -> None:
    conn.send(os.environ.get(ENV))


def _spawned_env() -> str | None:
    """`DSS_MASTER_KEY` as a process spawned now sees it (vLLM starts its engine core so)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_report, args=(child,))
    proc.start()
    try:
        assert parent.poll(120), "the spawned process did not answer"
        value: str | None = parent.recv()
    finally:
        proc.join(30)
    return value


def test_a_server_started_with_the_master_key_in_its_environment_passes_it_to_no_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = secrets.token_hex(32)
    monkeypatch.setenv(ENV, key)
    with TestClient(create_app(settings_for(tmp_path / "data", auth=DEV))) as c:
        started(c)
        # The store opened with the key from the environment (no key file was written) ...
        assert not (tmp_path / "data" / "master.key").exists()
        assert c.post("/v1/sessions", json={"session_id": "s"}, headers=as_user("kim")).status_code == 201
        # ... and no process started from now on inherits it.
        assert ENV not in os.environ
        assert _spawned_env() is None
        out = subprocess.run(
            [sys.executable, "-c", f"import os; print(os.environ.get({ENV!r}, 'absent'))"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == "absent"
        worker = _Worker()  # the page codec's helper process, as the store starts it
        try:
            environ = Path(f"/proc/{worker.proc.pid}/environ").read_bytes()
        finally:
            worker.stop()
        assert key.encode() not in environ and ENV.encode() not in environ
