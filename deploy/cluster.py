"""A local DSS cluster in one command: N `dss serve` behind HAProxy, on loopback only.

    .venv/bin/python deploy/cluster.py [--servers 2] [--no-engine] [--db-url URL] [--redis-url URL]

(`make cluster` runs it with the prepared default model.) Each server has its own data directory
under the work directory and its own name (`DSS_STORE__SERVER_ID` a, b, ...); all share one
PostgreSQL database (the dialogue state; created when missing), one Redis (the shared page tier)
and one master key (generated into the work directory, 0600, passed as `DSS_MASTER_KEY`).
HAProxy (deploy/haproxy.cfg, filled in here) listens in front and routes each session to one
server by its id. The launcher waits until every `/readyz` answers, prints how to try it, and on
Ctrl-C or SIGTERM stops everything it started: each child runs in its own process group, and the
whole group is signalled (a server's engine processes included), so nothing is left behind.

The functions below are what tests/deploy/test_router.py starts a cluster with, so the test exercises
the configuration shipped here.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = Path(__file__).with_name("haproxy.cfg")
LOOPBACK = "127.0.0.1"
DEFAULT_DB_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/dss_cluster"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/1"
DEFAULT_WORK_DIR = Path.home() / ".local" / "share" / "dss-cluster"
STOP_TIMEOUT_S = 60.0  # a server with an engine takes a few seconds to flush and stop


class ClusterError(Exception):
    """The cluster cannot start; the message says what to do."""


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """One `dss serve` of the cluster. `number` is its fixed place on HAProxy's hash ring."""

    name: str
    number: int
    port: int
    data_dir: Path

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


def server_specs(count: int, first_port: int, work_dir: Path) -> list[ServerSpec]:
    """Servers a, b, c, ... on consecutive ports, each with `<work_dir>/<name>/` as data directory."""
    if not 1 <= count <= 26:
        raise ClusterError(f"--servers must be between 1 and 26, not {count}")
    names = [chr(ord("a") + i) for i in range(count)]
    return [ServerSpec(n, i + 1, first_port + i, work_dir / n) for i, n in enumerate(names)]


# ------------------------------------------------------------------------------------------ HAProxy
def render_haproxy_config(
    servers: Sequence[ServerSpec], port: int, check_interval_ms: int = 1000, template: Path = TEMPLATE
) -> str:
    """deploy/haproxy.cfg with its markers filled in: the bind address, the check interval, one
    `server` line per server (with its fixed `id`, see the template)."""
    lines = [f"    server {s.name} {LOOPBACK}:{s.port} id {s.number} check" for s in servers]
    text = template.read_text()
    for marker, value in (
        ("@@bind@@", f"{LOOPBACK}:{port}"),
        ("@@check_inter@@", f"{check_interval_ms}ms"),
        ("@@servers@@", "\n".join(lines)),
    ):
        if marker not in text:
            raise ClusterError(f"{template} has no {marker} marker")
        text = text.replace(marker, value)
    return text


def ensure_haproxy(install: bool = True) -> str:
    """The haproxy executable; when it is missing, installed from the distribution's packages
    (as root, with apt-get), else a `ClusterError` that says how to install it."""
    found = _which_haproxy()
    if found is not None:
        return found
    how = "install it with `sudo apt-get install haproxy` (Debian, Ubuntu) or your system's package manager"
    if not install:
        raise ClusterError(f"haproxy is not installed; {how}")
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ClusterError(f"haproxy is not installed and this user cannot install it; {how}")
    print("haproxy is not installed; installing it with apt-get (Debian's haproxy package)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "haproxy"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
            raise ClusterError(f"`{' '.join(cmd)}` failed; {how}:\n" + "\n".join(tail))
    found = _which_haproxy()
    if found is None:
        raise ClusterError(f"apt-get installed haproxy but it is not on PATH; {how}")
    return found


def _which_haproxy() -> str | None:
    found = shutil.which("haproxy")
    if found is None and os.access("/usr/sbin/haproxy", os.X_OK):  # sbin is not on every user's PATH
        found = "/usr/sbin/haproxy"
    return found


def check_haproxy_config(haproxy: str, config: Path) -> None:
    done = subprocess.run(
        [haproxy, "-c", "-q", "-f", str(config)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise ClusterError(f"haproxy refuses {config}:\n{(done.stdout + done.stderr).strip()}")


# ------------------------------------------------------------------------------- shared resources
def ensure_database(db_url: str) -> None:
    """Create the PostgreSQL database of `db_url` when it does not exist (the servers create the
    schema themselves: migrations run at start-up, under an advisory lock). Other URLs: nothing."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    url = make_url(db_url)
    if not url.drivername.startswith("postgresql") or not url.database:
        return
    admin = create_engine(
        url.set(database="postgres"), isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
    )
    try:
        with admin.connect() as conn:
            exists = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": url.database}
            ).first()
            if exists is None:
                name = url.database.replace('"', '""')
                conn.execute(text(f'CREATE DATABASE "{name}"'))
                print(f"created the database {url.database}", flush=True)
    except OperationalError as exc:
        shown = url.render_as_string(hide_password=True)
        raise ClusterError(
            f"PostgreSQL does not answer at {shown} ({exc.orig}); start one (.ci/run shows how) "
            "or pass --db-url"
        ) from None
    finally:
        admin.dispose()


def check_redis(redis_url: str) -> str | None:
    """Why Redis does not answer at `redis_url` (a warning: the servers then serve from their local
    tiers only), or None when it answers PING."""
    import redis

    try:
        client = redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=2)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, OSError) as exc:
        return str(exc)
    return None


def master_key(work_dir: Path) -> str:
    """The cluster's one master key (64 hex characters, `dss.keys.crypto`'s format), kept in
    `<work_dir>/master.key` with mode 0600 and created on first use. Every server must have the
    same one: a page written by one is read by another."""
    path = work_dir / "master.key"
    work_dir.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    mode = path.stat().st_mode & 0o777
    if mode != 0o600:
        raise ClusterError(f"{path} has mode {mode:04o}; it must be 0600 (chmod 600 {path})")
    return path.read_text().strip()


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


# ---------------------------------------------------------------------------------------- processes
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
            render_haproxy_config(self.servers, self.router_port, self.check_interval_ms)
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


# --------------------------------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="deploy/cluster.py", description="N `dss serve` behind HAProxy on loopback (docs/operations.md)."
    )
    p.add_argument("--servers", type=int, default=2, help="how many dss serve processes (default 2)")
    p.add_argument("--port", type=int, default=8100, help="HAProxy's port (default 8100)")
    p.add_argument("--first-port", type=int, default=8101, help="the first server's port; the others follow")
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help=f"default {DEFAULT_WORK_DIR}")
    p.add_argument("--db-url", default=DEFAULT_DB_URL, help=f"shared PostgreSQL (default {DEFAULT_DB_URL})")
    p.add_argument(
        "--redis-url", default=DEFAULT_REDIS_URL, help=f"shared page tier (default {DEFAULT_REDIS_URL})"
    )
    p.add_argument("--no-redis", action="store_true", help="no shared page tier (local tiers only)")
    p.add_argument(
        "--no-engine", action="store_true", help="servers without the vLLM engine (the store API only)"
    )
    p.add_argument("--model", type=Path, default=None, help="an HF model folder (default: the prepared one)")
    p.add_argument("--keys", action="store_true", help="require API keys (default: development mode, --dev)")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an engine setting for every server, e.g. --engine max_model_len=4096 (DSS_ENGINE__NAME)",
    )
    p.add_argument(
        "--env", action="append", default=[], metavar="DSS_X=V", help="any setting for every server"
    )
    p.add_argument("--check-interval-ms", type=int, default=1000, help="HAProxy's health-check interval")
    return p.parse_args(argv)


def extra_env(engine: Sequence[str], env: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item, prefix in [*((e, "DSS_ENGINE__") for e in engine), *((e, "") for e in env)]:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ClusterError(f"expected NAME=VALUE, not {item!r}")
        out[prefix + (name.upper() if prefix else name)] = value
    return out


def usage(cluster: Cluster) -> str:
    router = cluster.router_url
    user = "" if not cluster.dev else " -H 'X-DSS-User: alice'"
    auth = "" if cluster.dev else ' -H "Authorization: Bearer $KEY"'
    servers = "\n".join(
        f"  server {s.name}: {s.url}  (data {s.data_dir}, log {cluster.log_path(s.name)})"
        for s in cluster.servers
    )
    chat = (
        f"curl -si {router}/v1/chat/completions -H 'Content-Type: application/json'{user}{auth} \\\n"
        '    -H \'X-DSS-Session: trip\' -d \'{"model": "default", "max_tokens": 16, '
        '"messages": [{"role": "user", "content": "Plan a day in Paris."}]}\''
    )
    store = (
        f"curl -si {router}/v1/sessions{user}{auth} -H 'Content-Type: application/json' \\\n"
        "    -H 'X-DSS-Session: trip' -d '{}'"
    )
    keys = (
        ""
        if cluster.dev
        else f"\nkeys: DSS_STORE__DB_URL={cluster.db_url} .venv/bin/dss keys create --user alice\n"
    )
    return (
        f"DSS cluster ready\n  router (HAProxy): {router}  "
        f"(config {cluster.config_path}, log {cluster.log_path('haproxy')})\n"
        f"{servers}\n{keys}\ntry it (the X-DSS-Server response header names the server that answered):\n"
        f"  {chat if cluster.engine else store}\n"
        "kill a server's process to see its sessions move to another; Ctrl-C stops everything."
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        haproxy = ensure_haproxy()
        redis_url = None if args.no_redis else args.redis_url
        if redis_url is not None and (why := check_redis(redis_url)) is not None:
            print(
                f"warning: Redis does not answer at {redis_url} ({why}); the servers serve from their local "
                "tiers until it does (start one: redis-server --save '' --appendonly no --daemonize yes)",
                flush=True,
            )
        cluster = Cluster(
            servers=server_specs(args.servers, args.first_port, args.work_dir),
            work_dir=args.work_dir,
            router_port=args.port,
            db_url=args.db_url,
            redis_url=redis_url,
            engine=not args.no_engine,
            model=args.model,
            dev=not args.keys,
            env=extra_env(args.engine, args.env),
            check_interval_ms=args.check_interval_ms,
            haproxy=haproxy,
        )
    except ClusterError as exc:
        print(f"cannot start the cluster: {exc}", file=sys.stderr)
        return 2
    with _stopped_by_sigterm(), cluster:
        try:
            print(
                f"starting {len(cluster.servers)} servers and HAProxy (logs in {cluster.work_dir})",
                flush=True,
            )
            cluster.start()
            print(usage(cluster), flush=True)
            _watch(cluster)
        except ClusterError as exc:
            print(f"cannot start the cluster: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nstopping the cluster", flush=True)
    return 0


def _watch(cluster: Cluster) -> None:
    """Until Ctrl-C: report servers that exit (the router moves their sessions); stop when the
    router itself exits."""
    reported: set[str] = set()
    while True:
        for name, proc in cluster.procs.items():
            if proc.poll() is not None and name not in reported:
                reported.add(name)
                if name == "haproxy":
                    raise ClusterError(f"haproxy exited ({proc.returncode}):\n{cluster.log_tail('haproxy')}")
                print(
                    f"server {name} exited ({proc.returncode}); the router sends its sessions elsewhere",
                    flush=True,
                )
        time.sleep(0.5)


@contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM stops the cluster like Ctrl-C does."""

    def on_term(_sig: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
