"""Start-up: the server listens first and reports readiness; refused or failed starts say why in
one line and exit non-zero. Real `dss serve` processes (one with the engine, shared with the
admission tests; the others without it or failing before it loads).

Before: the engine started inside the app's lifespan, so nothing listened until the model was
loaded (`/readyz` could never answer 503), and a refused start (a second server on a data
directory) printed uvicorn's 70-line traceback and exited 3.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.api_server import REPO, Answer, ApiServer, api_server, free_port, small_api_server

__all__ = ["api_server", "small_api_server"]


def test_listens_before_the_engine_is_ready(small_api_server: ApiServer) -> None:
    trace = small_api_server.start_trace
    shown = "\n".join(map(str, trace))
    ready = next(a for a in trace if a.probe == "readyz" and a.status == 200)
    before = [a for a in trace if a.at_s < ready.at_s]

    def seen(probe: str, status: int) -> list[Answer]:
        return [a for a in before if a.probe == probe and a.status == status]

    assert seen("healthz", 200), shown
    starting = [a for a in seen("readyz", 503) if a.body and a.body.get("reason") == "engine starting"]
    assert starting, shown
    assert starting[0].body == {
        "status": "not ready",
        "reason": "engine starting",
        "store": True,
        "engine": False,
        "dev_mode": False,
        "tiers": {"disk": "ok"},  # tiers it may serve without; "remote" too when configured
    }, shown
    chats = seen("chat", 503)
    assert chats and all(a.retry_after for a in chats), shown
    assert any(a.body and a.body["error"]["code"] == "engine_unavailable" for a in chats), shown
    assert ready.body == {
        "status": "ready",
        "kv_caching": True,  # DSS stores this engine's KV (false: served uncached, by choice)
        "store": True,
        "engine": True,
        "dev_mode": False,
        "tiers": {"disk": "ok"},
    }


def serve(
    data_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "api.cli", "serve", "--data-dir", str(data_dir),
        "--host", "127.0.0.1", "--port", str(port), *extra,
    ]  # fmt: skip
    env = {"PYTHONUNBUFFERED": "1", "PATH": "/usr/bin:/bin", "HOME": str(data_dir.parent), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, port


def wait_ready(proc: subprocess.Popen[str], port: int) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_a_second_server_on_one_data_dir_exits_2_with_one_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first, port = serve(data, "--no-engine")
    try:
        wait_ready(first, port)
        second, _ = serve(data, "--no-engine")
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and len(lines[0]) < 200, err
        assert "another process owns the data directory" in lines[0] and "--data-dir" in lines[0], err
    finally:
        first.terminate()
        first.communicate(timeout=30)


@pytest.mark.timeout(60)
def test_an_invalid_setting_exits_2_with_one_line_per_value(tmp_path: Path) -> None:
    # Before: a pydantic traceback of some 40 lines, exit 1.
    bad = {"DSS_ENGINE__NICE": "99", "DSS_ENGINE__DTYPE": "float33"}
    proc, _ = serve(tmp_path / "data", "--no-engine", env=bad)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and all(
        line.startswith("dss serve: invalid setting DSS_ENGINE__") for line in lines
    )
    assert "DSS_ENGINE__NICE" in err and "DSS_ENGINE__DTYPE" in err


@pytest.mark.timeout(60)
def test_dev_mode_on_a_public_bind_exits_2_with_one_line(tmp_path: Path) -> None:
    proc, _ = serve(tmp_path / "data", "--no-engine", "--dev", "--host", "0.0.0.0")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "refusing development mode on 0.0.0.0" in lines[0], err


@pytest.mark.timeout(120)
def test_an_engine_that_cannot_start_exits_1_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "not-a-model").mkdir()
    proc, _ = serve(tmp_path / "data", "--model", str(tmp_path / "not-a-model"), "--log-level", "warning")
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, err
    assert "Traceback" not in err, err
    failure = [line for line in err.splitlines() if "start-up failed" in line]
    assert len(failure) == 1 and "not-a-model is not an HF model folder" in failure[0], err


def test_readyz_and_metrics_say_caching_is_on(api_server: ApiServer) -> None:
    client = api_server.client("admin", admin=True)
    ready = client.get("/readyz")
    # "engine not healthy" means vLLM's engine is dead (its health check asks nothing else): in
    # stop 34's CI the kernel's OOM killer had taken its worker (tests/conftest.py). Its log says.
    assert ready.status_code == 200 and ready.json()["kv_caching"] is True, (
        ready.text + "\n" + api_server.log_tail(120)
    )
    assert "uncached_reason" not in ready.json()
    text = api_server.client("admin", admin=True).get("/metrics").text
    assert re.search(r"^dss_kv_caching_enabled 1\.0$", text, re.M), text
