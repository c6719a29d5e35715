"""`Cluster`: the processes of one local cluster. Servers start first (each `dss serve` with its own
data directory and name, the shared database, Redis and master key) and must answer `/readyz`;
then HAProxy, which must answer through to them. Each child runs in its own process group and dies
with the launcher however it dies; stopping signals whole groups (a server's engine processes
included), the router first, so nothing is left behind."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from deploy.haproxy import check_haproxy_config, render_haproxy_config
from deploy.shared import ensure_database, master_key, port_free
from deploy.spec import DEFAULT_DB_URL, DEFAULT_REDIS_URL, LOOPBACK, ClusterError, ServerSpec

REPO = Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 60.0  # a server with an engine takes a few seconds to flush and stop


def die_with_parent() -> None:
    """In a child before exec: SIGTERM it when the launcher dies, however it dies (kill -9 too)."""
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass
class Cluster:
    """The processes of one cluster. Use as a context manager: leaving it stops them all."""

    servers: Sequence[ServerSpec]
    work_dir: Path
    router_port: int = 8100
    db_url: str | None = DEFAULT_DB_URL  # None: SQLite in each data directory (nothing shared)
    redis_url: str | None = DEFAULT_REDIS_URL  # None: no shared page tier
    engine: bool = False
    model: Path | None = None
    dev: bool = True
    env: Mapping[str, str] = field(default_factory=dict)  # extra DSS_* settings for every server
    check_interval_ms: int = 1000
    haproxy: str = "haproxy"
    session_headers: Sequence[str] = ()  # frontend session headers the router reads (haproxy.cfg)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, init=False)

    @property
    def router_url(self) -> str:
        return f"http://{LOOPBACK}:{self.router_port}"

    @property
    def config_path(self) -> Path:
        return self.work_dir / "haproxy.cfg"

    def log_path(self, name: str) -> Path:
        return self.work_dir / f"{name}.log"

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -------------------------------------------------------------------------------- start
    def start(self, ready_timeout_s: float = 600.0) -> None:
        """Everything, in order: servers (ready), then the router (answering)."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        busy = [p for p in [self.router_port, *(s.port for s in self.servers)] if not port_free(p)]
        if busy:
            raise ClusterError(
                f"ports already in use on {LOOPBACK}: {busy} (choose others with --port/--first-port)"
            )
        if self.db_url is not None:
            ensure_database(self.db_url)
        key = master_key(self.work_dir)
        for spec in self.servers:
            self.start_server(spec, key)
        deadline = time.monotonic() + ready_timeout_s
        for spec in self.servers:
            self.wait_ready(spec, deadline)
        self.start_router()
        self._wait_router(deadline)

    def server_env(self, spec: ServerSpec, key: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSS_STORE__")}
        env.update(
            {
                "DSS_STORE__SERVER_ID": spec.name,
                "DSS_STORE__DATA_DIR": str(spec.data_dir),
                "DSS_MASTER_KEY": key,
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.db_url is not None:
            env["DSS_STORE__DB_URL"] = self.db_url
        if self.redis_url is not None:
            env["DSS_STORE__REMOTE_URL"] = self.redis_url
        env.update(self.env)
        return env

    def server_command(self, spec: ServerSpec) -> list[str]:
        engine = ["--no-engine"] if not self.engine else (["--model", str(self.model)] if self.model else [])
        return [
            sys.executable, "-m", "api.cli", "serve", *engine,
            "--data-dir", str(spec.data_dir),
            "--host", LOOPBACK,
            "--port", str(spec.port),
            *(["--dev"] if self.dev else []),
        ]  # fmt: skip

    def start_server(self, spec: ServerSpec, key: str) -> None:
        spec.data_dir.mkdir(parents=True, exist_ok=True)
        self._spawn(spec.name, self.server_command(spec), self.server_env(spec, key))

    def start_router(self) -> None:
        self.config_path.write_text(
            render_haproxy_config(
                self.servers, self.router_port, self.check_interval_ms, session_headers=self.session_headers
            )
        )
        check_haproxy_config(self.haproxy, self.config_path)
        # -db: stay in the foreground (a child of this launcher, stopped with it).
        self._spawn("haproxy", [self.haproxy, "-db", "-f", str(self.config_path)], dict(os.environ))

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        with open(self.log_path(name), "ab") as log:
            self.procs[name] = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped as a whole
                preexec_fn=die_with_parent,
            )

    def wait_ready(self, spec: ServerSpec, deadline: float) -> None:
        proc = self.procs[spec.name]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ClusterError(
                    f"server {spec.name} exited ({proc.returncode}):\n{self.log_tail(spec.name)}"
                )
            try:
                if httpx.get(spec.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise ClusterError(f"server {spec.name} was not ready in time:\n{self.log_tail(spec.name)}")

    def _wait_router(self, deadline: float) -> None:
        proc = self.procs["haproxy"]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ClusterError(f"haproxy exited ({proc.returncode}):\n{self.log_tail('haproxy')}")
            try:
                if httpx.get(self.router_url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise ClusterError(f"haproxy did not answer in time:\n{self.log_tail('haproxy')}")

    # --------------------------------------------------------------------------------- stop
    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Signal a child's whole process group (a server and its engine) and reap the child."""
        proc = self.procs[name]
        _signal_group(proc, sig)
        proc.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM every process group (the router first: no new requests), wait, then SIGKILL
        what is left of each group."""
        order = sorted(self.procs, key=lambda n: n != "haproxy")
        for name in order:
            _signal_group(self.procs[name], signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for name in order:
            proc = self.procs[name]
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{name} did not stop in {STOP_TIMEOUT_S:.0f} s; killing it", flush=True)
            _signal_group(proc, signal.SIGKILL)  # stragglers of the group, if any
            proc.wait()
        self.procs.clear()

    def log_tail(self, name: str, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path(name).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)  # start_new_session: the group id is the child's pid
