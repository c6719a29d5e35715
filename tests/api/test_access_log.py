"""The server's access log names route templates, never concrete paths: `DELETE /v1/users/alice`
kept an erased user's id in uvicorn's log, and session ids and query strings are user data too.
A real `dss serve --no-engine` on loopback in development mode."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx

from tests.api_server import REPO, die_with_parent, free_port, serve_command


def test_access_log_has_templates_not_user_ids(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "server.log"
    cmd = serve_command(None, tmp_path / "data", port, dev=True, log_level="info")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        h = {"X-DSS-User": "alice-secret-id"}
        with httpx.Client(base_url=base, headers=h, timeout=10) as c:
            assert c.post("/v1/sessions", json={"session_id": "trip-to-lyon"}).status_code == 201
            assert c.get("/v1/sessions?after=trip-to-lyon").status_code == 200  # an id in a query
            assert c.get("/v1/sessions/trip-to-lyon/versions?after=0").status_code == 200
            assert c.delete("/v1/users/alice-secret-id").status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
    text = log_path.read_text(errors="replace")
    assert "DELETE /v1/users/{user_id} 200" in text, text[-3000:]
    assert "GET /v1/sessions/{session_id}/versions 200" in text
    for secret in ("alice-secret-id", "trip-to-lyon"):
        assert secret not in text, f"{secret!r} is in the server log"
