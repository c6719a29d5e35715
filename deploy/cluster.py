"""A local DSS cluster in one command: N `dss serve` behind HAProxy, on loopback only.

    .venv/bin/python deploy/cluster.py [--servers 3] [--no-engine] [--session-header NAME]
        [--db-url URL] [--redis-url URL]

(`make cluster` runs it with the prepared default model.) Each server has its own data directory
under the work directory and its own name (`DSS_STORE__SERVER_ID` a, b, ...); all share one
PostgreSQL database (the dialogue state; created when missing), one Redis (the shared page tier)
and one master key (generated into the work directory, 0600, passed as `DSS_MASTER_KEY`).
HAProxy (deploy/haproxy.cfg, filled in here) listens in front and routes each session to one
server by its id. The launcher waits until every `/readyz` answers, prints how to try it, and on
Ctrl-C or SIGTERM stops everything it started: each child runs in its own process group, and the
whole group is signalled (a server's engine processes included), so nothing is left behind.

This script is the command line; the parts are the modules beside it, and tests/deploy/test_router.py
starts a cluster with the same ones, so the test exercises the configuration shipped here: `spec`
(servers, defaults, `ClusterError`), `haproxy` (the router's configuration and executable),
`shared` (database, Redis, master key, ports), `launcher` (`Cluster`: the processes).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository
from deploy.haproxy import ensure_haproxy
from deploy.launcher import Cluster
from deploy.shared import check_redis
from deploy.spec import DEFAULT_DB_URL, DEFAULT_REDIS_URL, ClusterError, server_specs

DEFAULT_WORK_DIR = Path.home() / ".local" / "share" / "dss-cluster"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="deploy/cluster.py", description="N `dss serve` behind HAProxy on loopback (docs/operations.md)."
    )
    p.add_argument("--servers", type=int, default=3, help="how many dss serve processes (default 3)")
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
    p.add_argument(
        "--session-header",
        action="append",
        default=[],
        metavar="NAME",
        help="a frontend's session header (its key's --session-header, e.g. X-OpenWebUI-Chat-Id) that the "
        "router keeps a session on one server by; repeat for several frontends",
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


def startup_warnings(args: argparse.Namespace) -> list[str]:
    """One line per "try it" default still in effect (docs/operations.md, "A cluster for
    production" says what to set instead): the launcher's defaults suit one trusted machine."""
    warnings = []
    if not args.keys:
        warnings.append(
            "development mode: no API keys, any caller may act as any user (X-DSS-User); "
            "give --keys to require keys"
        )
    try:
        db_url = make_url(args.db_url)
    except ArgumentError as exc:
        raise ClusterError(f"--db-url is not a database URL: {exc}") from exc
    if db_url.password is None:
        warnings.append(
            f"PostgreSQL without a password ({db_url.render_as_string(hide_password=True)}): "
            "give --db-url postgresql+psycopg://USER:PASSWORD@HOST/DB (a role with a password, "
            "and no trust authentication in pg_hba.conf)"
        )
    if not args.no_redis and urlsplit(args.redis_url).password is None:
        warnings.append(
            f"Redis without a password ({args.redis_url}): give --redis-url "
            "redis://:PASSWORD@HOST:6379/1 (requirepass or an ACL user), or --no-redis"
        )
    return [f"warning: insecure default: {w}" for w in warnings]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        for warning in startup_warnings(args):
            print(warning, file=sys.stderr, flush=True)
        servers = server_specs(args.servers, args.first_port, args.work_dir)
        haproxy = ensure_haproxy()
        redis_url = None if args.no_redis else args.redis_url
        if redis_url is not None and (why := check_redis(redis_url)) is not None:
            print(
                f"warning: Redis does not answer at {redis_url} ({why}); the servers serve from their local "
                "tiers until it does (start one: redis-server --save '' --appendonly no --daemonize yes)",
                flush=True,
            )
        cluster = Cluster(
            servers=servers,
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
            session_headers=args.session_header,
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
