"""The soak's server side (`bench/soak.py`, also used by `bench/schemathesis_stateful.py`): API keys
through `dss keys create`, and `dss serve` started in its own process group (SIGKILL takes the API
process and the engine at once), with small tiers so that eviction runs, its `/metrics` scraped."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/, for _procs
from _procs import die_hard_with_parent, model_dir, serve_command

REPO = Path(__file__).resolve().parents[2]
# The code the server runs: the checkout, or (`--server-root`) another copy of it, e.g. a
# `git archive` of a commit, imported first through PYTHONPATH (the venv's editable install of the
# checkout comes after it on the import path). Set with `use_server_root`.
SERVER_ROOT = REPO
MIB = 1 << 20
START_TIMEOUT_S = 420.0
STOP_TIMEOUT_S = 90.0


def use_server_root(root: Path) -> None:
    global SERVER_ROOT
    SERVER_ROOT = root.resolve()


def dss_cli() -> list[str]:
    script = Path(sys.executable).with_name("dss")
    return [str(script)] if script.exists() else [sys.executable, "-m", "api.cli"]


def code_env() -> dict[str, str]:
    env = dict(os.environ)
    if SERVER_ROOT != REPO:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SERVER_ROOT), env.get("PYTHONPATH")]))
    return env


def create_key(data_dir: Path, user: str | None, db_url: str | None = None) -> str:
    """`dss keys create --user NAME` / `--admin`: the key."""
    return _keys_create(data_dir, ["--admin"] if user is None else ["--user", user], db_url)


def create_frontend_key(
    data_dir: Path, frontend: str, user_header: str, session_header: str, db_url: str | None = None
) -> str:
    """`dss keys create --frontend NAME` (registering the frontend with the headers its keys
    trust: `user_header` names the end user, `session_header` the session; docs/frontends.md)."""
    who = ["--frontend", frontend, "--user-header", user_header, "--session-header", session_header]
    return _keys_create(data_dir, who, db_url)


def _keys_create(data_dir: Path, who: list[str], db_url: str | None) -> str:
    """`dss keys create` for `who`: the key is the last line of its stdout."""
    cmd = [*dss_cli(), "keys", "create", "--data-dir", str(data_dir)]
    cmd += ["--db-url", db_url] if db_url else []
    cmd += who
    proc = subprocess.run(
        cmd, cwd=SERVER_ROOT, env=code_env(), capture_output=True, text=True, timeout=120, check=False
    )
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return lines[-1]


def try_create_key(data_dir: Path, user: str, db_url: str | None = None) -> str | None:
    """A user's key, or None where `dss keys create` refuses the id."""
    try:
        return create_key(data_dir, user, db_url)
    except SystemExit:
        return None


def user_path(user: str) -> str:
    """`/v1/users/{id}` with the id percent-encoded (a `/` in it is data, not a path separator)."""
    return "/v1/users/" + urllib.parse.quote(user, safe="")


def parse_metrics(text: str) -> dict[str, float]:
    """The few counters the soak reads, from the Prometheus text format."""
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        try:
            v = float(value)
        except ValueError:
            continue
        if name in (
            "dss_corrupt_pages_total",
            "dss_connector_store_errors_total",
            "dss_disk_write_errors_total",
            "dss_generations_aborted_total",
            "dss_versions_committed_total",
        ):
            out[name] += v
        elif name == "dss_http_requests_total" and re.search(r'status="5\d\d"', labels):
            route = re.search(r'route="([^"]*)"', labels)
            status = re.search(r'status="(\d+)"', labels)
            where = f"{route.group(1) if route else '?'} {status.group(1) if status else '?'}"
            out[f"5xx by route: {where}"] += v
            # /readyz answers 503 by design while the engine starts (the soak polls it then).
            if route is None or route.group(1) not in ("/readyz", "/healthz"):
                out["server_5xx"] += v
        elif name == "dss_evictions_total":
            out["evictions"] += v
    return dict(out)


# ------------------------------------------------------------------------------------ server
class Server:
    """`dss serve` in its own process group; SIGKILL takes the group (API and engine) at once."""

    def __init__(self, data_dir: Path, port: int, log_path: Path, admin_key: str) -> None:
        self.data_dir = data_dir
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.admin_key = admin_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.last_metrics: dict[str, float] = {}
        self.metrics_total: Counter[str] = Counter()
        self.start_seconds: list[float] = []

    def env(self) -> dict[str, str]:
        env = code_env()
        env.update(
            {
                "DSS_STORE__HOST_CAPACITY_BYTES": str(64 * MIB),
                "DSS_STORE__DISK_CAPACITY_BYTES": str(256 * MIB),
                "DSS_ENGINE__KV_CACHE_SPACE_GIB": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "DSS_ENGINE__MAX_MODEL_LEN": "2048",
                "DSS_LIMITS__MAX_OUTPUT_TOKENS": "128",
                "DSS_LIMITS__DEFAULT_MAX_TOKENS": "16",
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def start(self) -> None:
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(
                f"\n===== soak: start #{self.starts + 1} at {time.strftime('%H:%M:%S')} =====\n".encode()
            )
            cmd = serve_command(model_dir(), self.data_dir, self.port, cli=dss_cli())
            self.proc = subprocess.Popen(
                cmd,
                cwd=SERVER_ROOT,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: os.killpg reaches the engine too
                preexec_fn=die_hard_with_parent,
            )
        self.starts += 1
        self.last_metrics = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited during start-up ({self.proc.returncode})")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/readyz", timeout=3).status_code == 200:
                    self.start_seconds.append(time.monotonic() - t0)
                    return
            time.sleep(0.5)
        raise RuntimeError(f"the server was not ready after {START_TIMEOUT_S:.0f} s")

    def scrape(self) -> dict[str, float] | None:
        try:
            r = httpx.get(
                self.base_url + "/metrics", headers={"Authorization": f"Bearer {self.admin_key}"}, timeout=10
            )
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        self.last_metrics = parse_metrics(r.text)
        return self.last_metrics

    def _bank_metrics(self) -> None:
        """Counters restart from 0 with each process: keep the last scrape of the one ending."""
        self.metrics_total.update(self.last_metrics)
        self.last_metrics = {}

    def _group_alive(self, pgid: int) -> bool:
        import psutil

        for p in psutil.process_iter(["status"]):
            with contextlib.suppress(psutil.Error, OSError):
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    return True
        return False

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        self._bank_metrics()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 60
        while self._group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self) -> tuple[int | None, float]:
        """Graceful stop (SIGTERM to the API process); SIGKILL the group if it does not end."""
        proc = self.proc
        if proc is None:
            return None, 0.0
        self._bank_metrics()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc: int | None = proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        self.proc = proc
        self.kill()
        return rc, took
