"""Three DSS servers (two in `--smoke`) sharing one PostgreSQL, one Redis page tier and one master key, behind
HAProxy (deploy/haproxy.cfg through deploy/launcher.py), measured in one run (real vLLM engines
on the default model, HTTP on loopback, streamed, greedy):

- `cross_server_ttft_vs_cold`: a session's turn 1 runs on server A; its turn 2 runs on server B,
  which never saw the session and loads its KV from Redis. Its TTFT over the TTFT of the same
  request sent cold (another user, so nothing of it is cached anywhere) to B, interleaved.
  Goal <= 0.2 (issue 30).
- `failover_ttft_vs_cold`: the same right after A was killed with `kill -9` (its sessions' turn 1
  ran on A just before; B continues them).
- `remote_load_mbps`: MB/s at which B's read path (`RemoteTier.read_many`: pipelined batches,
  decoding, promotion into its host tier) read the cross-server turns' pages from Redis: bytes
  read over the reads' wall-clock seconds (`dss_remote_read_wall_seconds_total`) plus their
  promotion's (`dss_remote_read_seconds_total{phase="promote"}`), as Redis's ceiling below is
  wall-clock too. (Until 2026-12-05: over the three phases' seconds summed over the reader
  threads, which overlap, so about half the rate on two threads; printed beside it.)
- `redis_ceiling_mbps`: Redis's own ceiling for the same values on this machine: every page this
  run stored, read back with plain pipelined GETs and no decoding (`bench/remote_read.py`'s
  `ceiling`, the best of a few batch shapes). Goal: `remote_load_mbps` at least half of it.
- `routed_to_holder`: the share of the ways of naming a session (`X-DSS-Session`, `X-Session-ID`,
  the body's `session_id`, a frontend key's session header, a `conversation`, a
  `previous_response_id` chain) whose turns, sent through HAProxy, all landed on the server that
  answered the session's first turn (the one whose host tier holds its KV). Goal 1.0.
- `lost_versions`: versions a client got a `state_version` for that B cannot list after the
  failover (goal 0).
- `erase_fleet_s`: `DELETE /v1/users/{id}` on A (restarted after the failover) until its receipt
  came back with B's acknowledgement.

    .venv/bin/python bench/cluster.py                 # ~7 min on 2 cores
    .venv/bin/python bench/cluster.py --sessions 2    # quicker
    .venv/bin/python bench/cluster.py --smoke         # ~100 s: two servers, one session per phase and form

Needs PostgreSQL (`DSS_TEST_PG_URL`, default the local `test` server; a fresh database is made and
dropped) and Redis (`DSS_TEST_REDIS_URL`, keys under a fresh prefix, removed at the end).
HAProxy is installed with apt-get when missing (as `make cluster` does). The last line is
`RESULT cross_server_ttft_vs_cold= failover_ttft_vs_cold= remote_load_mbps= redis_ceiling_mbps=
routed_to_holder= lost= lost_versions= erase_fleet_s= warmup_stalls=` (`lost` and `lost_versions` are
the same count: the issue's key and the earlier one; `warmup_stalls`: warm-up turns sent twice
because the first got no answer in 60 s, each with its server's thread dump printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from deploy.haproxy import ensure_haproxy  # noqa: E402 - after the path is set
from deploy.launcher import Cluster  # noqa: E402 - after the path is set
from deploy.spec import ServerSpec  # noqa: E402 - after the path is set
from engine_patch.setup.model import NOT_PREPARED  # noqa: E402 - after the path is set
from tests.api_server import ApiServer, free_port, model_dir  # noqa: E402 - after the path is set

PG_URL = os.environ.get("DSS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("DSS_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
SYSTEM = " ".join(f"Rule {i}: answer in one short sentence, politely, without lists." for i in range(110))
QUESTIONS = ("Name a river.", "Name a mountain.", "Name a lake.", "Name a forest.", "Name a desert.")
# The frontend key of the routing phase: its end-user and session headers (as Open WebUI's are).
FRONTEND_USER_HEADER = "X-Bench-User-Id"
FRONTEND_SESSION_HEADER = "X-Bench-Chat-Id"


def fresh_database() -> tuple[str, Any, str]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    server = make_url(PG_URL)
    name = f"dss_bench_cluster_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    return server.set(database=name).render_as_string(hide_password=False), admin, name


def drop_database(admin: Any, name: str) -> None:
    from sqlalchemy import text

    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def streamed_turn(
    server: ApiServer, user: str, messages: list[dict[str, str]], sid: str | None, timeout_s: float = 300
) -> dict[str, Any]:
    """One streamed chat turn: TTFT (first chunk with content), its text, its version."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": 12, "temperature": 0, "stream": True}
    if sid is not None:
        body["session_id"] = sid
    # The user's API key first: a new user's is made in the server's database by this harness
    # (`ApiServer.key`), 50-80 ms that are no part of the request's time to first token. The
    # client too: building one (its TLS context) takes 30-45 ms here, which a frontend, holding
    # its clients, does not pay per request (until 2026-12-06 it was inside the timing, on the
    # cross-server, failover and cold turns alike).
    headers = server.headers(user)
    text, version, ttft = "", None, None
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=timeout_s) as c:
        t0 = time.perf_counter()
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {r.read()!r}")
            for line in r.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices", []):
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text += piece
                    version = choice.get("state_version", version)
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "text": text, "version": version}


def warm_up(name: str, server: ApiServer) -> int:
    """One throwaway turn (a few tokens: seconds). A turn that gets no answer for 60 s is a stall:
    the server's threads are dumped into its log (`kill -USR1`, see docs/operations.md), the log
    is printed, and the turn is sent once more. Returns the stalls (reported in RESULT)."""
    for attempt in range(2):
        try:
            streamed_turn(server, "warmup", [{"role": "user", "content": "Hi."}], None, timeout_s=60)
            return attempt
        except httpx.TimeoutException:
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGUSR1)
            time.sleep(2)
            print(f"STALL: server {name}'s warm-up turn got no answer in 60 s; its log:", flush=True)
            print(server.log_tail(300), flush=True)
    raise RuntimeError(f"server {name}'s warm-up turn stalled twice")


def wait_written_behind(server: ApiServer, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=server.base_url, headers=server.headers("admin", True), timeout=10) as c:
        while time.monotonic() < deadline:
            for line in c.get("/metrics").text.splitlines():
                if line.startswith("dss_disk_write_backlog") and float(line.split()[-1]) == 0:
                    return
            time.sleep(0.2)
    raise RuntimeError("the writer did not drain")


def metric(server: ApiServer, name: str) -> float:
    with httpx.Client(base_url=server.base_url, headers=server.headers("admin", True), timeout=10) as c:
        for line in c.get("/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "_total "):
                return float(line.split()[-1])
    return 0.0


def read_seconds(server: ApiServer) -> tuple[float, float]:
    """The seconds of the server's remote reads: (wall clock plus promotion, the three phases
    summed over the reader threads)."""
    with httpx.Client(base_url=server.base_url, headers=server.headers("admin", True), timeout=10) as c:
        lines = c.get("/metrics").text.splitlines()
    phases = {
        line.split('"')[1]: float(line.split()[-1])
        for line in lines
        if line.startswith("dss_remote_read_seconds_total{")
    }
    wall = next(
        (float(ln.split()[-1]) for ln in lines if ln.startswith("dss_remote_read_wall_seconds_total ")), 0.0
    )
    return wall + phases.get("promote", 0.0), sum(phases.values())


def redis_ceiling_mbps(prefix: str) -> tuple[float, int]:
    """Plain pipelined GETs of every page of this run (keys `<prefix>{bucket}p:<hash>`)."""
    import redis
    from remote_read import ceiling

    client = redis.Redis.from_url(REDIS_URL)
    keys = [k.decode() for k in client.scan_iter(f"{prefix}*p:*")]
    client.close()
    return (ceiling(keys) if keys else 0.0), len(keys)


def first_turns(a: ApiServer, names: list[str], system: str = SYSTEM) -> dict[str, list[dict[str, str]]]:
    """Turn 1 of each session on A; returns each session's history."""
    histories: dict[str, list[dict[str, str]]] = {}
    for i, name in enumerate(names):
        msgs = [
            {"role": "system", "content": system},
            {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]},
        ]
        r = streamed_turn(a, f"u-{name}", msgs, name)
        assert r["version"] == 1, r
        histories[name] = [*msgs, {"role": "assistant", "content": r["text"]}]
    return histories


def second_turns(
    b: ApiServer, histories: dict[str, list[dict[str, str]]], acked: list[tuple[str, int]]
) -> tuple[list[float], list[float]]:
    """Turn 2 of each session on B, each followed by the same request sent cold (another user)."""
    warm, cold = [], []
    for name, history in histories.items():
        msgs = [*history, {"role": "user", "content": "Why that one?"}]
        r = streamed_turn(b, f"u-{name}", msgs, name)
        acked.append((name, int(r["version"])))
        warm.append(r["ttft"])
        cold.append(streamed_turn(b, f"cold-{name}-{uuid.uuid4().hex[:6]}", msgs, None)["ttft"])
    return warm, cold


def frontend_key(server: ApiServer) -> str:
    """A frontend key whose requests name the end user and the session in headers."""
    import subprocess

    created = subprocess.run(
        [
            sys.executable, "-m", "api.cli", "keys", "create", "--frontend", "bench-frontend",
            "--user-header", FRONTEND_USER_HEADER, "--session-header", FRONTEND_SESSION_HEADER,
            "--data-dir", str(server.data_dir),
        ],
        cwd=REPO, env=server.env(), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return created.stdout.strip().splitlines()[-1]


def start_router(servers: dict[str, ApiServer], work: Path) -> Cluster:
    """HAProxy with the shipped configuration in front of `servers`, each in its pool."""
    work.mkdir(parents=True, exist_ok=True)
    specs = [ServerSpec(name, i + 1, s.port, s.data_dir) for i, (name, s) in enumerate(servers.items())]
    router = Cluster(
        servers=specs,
        work_dir=work,
        router_port=free_port(),
        haproxy=ensure_haproxy(),
        check_interval_ms=500,
        session_headers=[FRONTEND_SESSION_HEADER],
    )
    router.start_router()
    deadline, up = time.monotonic() + 30, set()
    while up != set(servers):  # answering, and every server passed its health check
        with contextlib.suppress(httpx.HTTPError):
            up.add(httpx.get(router.router_url + "/healthz", timeout=2).headers["X-DSS-Server"])
        if time.monotonic() > deadline:
            raise RuntimeError(f"HAProxy did not reach every server: {up}\n{router.log_tail('haproxy')}")
        time.sleep(0.05)
    return router


def routed_turns(router_url: str, key: str, frontend: str, form: str, name: str, turns: int) -> list[str]:
    """`turns` turns of one session named by `form`, through the router: the server of each."""
    servers: list[str] = []
    auth = {"Authorization": f"Bearer {key}"}
    history: list[dict[str, str]] = [{"role": "system", "content": "Answer in one short sentence."}]
    previous: str | None = None
    with httpx.Client(base_url=router_url, timeout=300) as c:
        conversation = None
        if form == "conversation":
            r = c.post("/v1/conversations", json={}, headers=auth)
            r.raise_for_status()
            conversation = r.json()["id"]
            servers.append(r.headers["X-DSS-Server"])
        for t in range(turns):
            question = QUESTIONS[t % len(QUESTIONS)]
            if form in ("conversation", "previous_response_id"):
                body: dict[str, Any] = {"input": question, "max_output_tokens": 4, "temperature": 0}
                if conversation is not None:
                    body["conversation"] = conversation
                elif previous is not None:
                    body["previous_response_id"] = previous
                r = c.post("/v1/responses", json=body, headers=auth)
                if r.status_code != 200:
                    raise RuntimeError(f"{form}: {r.status_code}: {r.text}")
                previous = r.json()["id"]
            else:
                history.append({"role": "user", "content": question})
                body = {"messages": history, "max_tokens": 4, "temperature": 0}
                headers = dict(auth)
                if form == "X-DSS-Session" or form == "X-Session-ID":
                    headers[form] = name
                elif form == "session_id":
                    body["session_id"] = name
                elif form == "frontend session header":
                    headers = {
                        "Authorization": f"Bearer {frontend}",
                        FRONTEND_USER_HEADER: f"end-user-{name}",
                        FRONTEND_SESSION_HEADER: name,
                    }
                r = c.post("/v1/chat/completions", json=body, headers=headers)
                if r.status_code != 200:
                    raise RuntimeError(f"{form}: {r.status_code}: {r.text}")
                answer = r.json()
                assert answer.get("session_id") == name, answer
                history.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            servers.append(r.headers["X-DSS-Server"])
    return servers


ROUTING_FORMS = (
    "X-DSS-Session",
    "X-Session-ID",
    "session_id",
    "frontend session header",
    "conversation",
    "previous_response_id",
)


def routing(router_url: str, a: ApiServer, sessions: int, turns: int) -> dict[str, list[list[str]]]:
    """Each form's sessions through the router: the servers of each session's turns."""
    frontend = frontend_key(a)
    out: dict[str, list[list[str]]] = {}
    for form in ROUTING_FORMS:
        key = a.key(f"u-route-{form.replace(' ', '-')}")
        out[form] = [
            routed_turns(router_url, key, frontend, form, f"route-{i}-{uuid.uuid4().hex[:6]}", turns)
            for i in range(sessions)
        ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=4, help="sessions per phase (cross-server, failover)")
    ap.add_argument("--route-sessions", type=int, default=2, help="sessions per way of naming one")
    ap.add_argument("--turns", type=int, default=3, help="turns per routed session")
    ap.add_argument(
        "--smoke", action="store_true", help="two servers, one session per phase and per form, 2 turns"
    )
    args = ap.parse_args()
    if args.smoke:
        args.sessions, args.route_sessions, args.turns = 1, 1, 2
    model = model_dir()
    if model is None:
        sys.exit(NOT_PREPARED)
    db_url, admin, db_name = fresh_database()
    prefix = f"bench-{uuid.uuid4().hex[:8]}:"
    root = Path(tempfile.mkdtemp(prefix="dss-bench-cluster-"))
    env = {
        "DSS_STORE__DB_URL": db_url,
        "DSS_MASTER_KEY": secrets.token_hex(32),
        "DSS_STORE__REMOTE_URL": REDIS_URL,
        "DSS_STORE__REMOTE_KEY_PREFIX": prefix,
        "DSS_ENGINE__MAX_MODEL_LEN": "4096",
    }
    names = "ab" if args.smoke else "abc"  # the smoke's third would cost an engine start, not a phase
    servers = {n: ApiServer(model, root / n, env={**env, "DSS_STORE__SERVER_ID": n}) for n in names}
    a, b = servers["a"], servers["b"]
    router: Cluster | None = None
    try:
        # A and B at once (an engine start is mostly one core's imports), the third after them:
        # three engine starts at once starve 2 cores.
        a.launch()
        b.launch()
        a.wait_ready()
        b.wait_ready()
        for extra in list(servers.values())[2:]:
            extra.start()
        stalls = sum(warm_up(name, s) for name, s in servers.items())
        # Every way of naming a session, through HAProxy (short turns: only where they land counts).
        router = start_router(servers, root / "router")
        routes = routing(router.router_url, a, args.route_sessions, args.turns)
        router.stop()
        router = None
        held = {form: all(len(set(turns)) == 1 for turns in done) for form, done in routes.items()}
        routed = sum(held.values()) / len(held)

        n = args.sessions
        acked: list[tuple[str, int]] = []
        system = SYSTEM if not args.smoke else SYSTEM[: len(SYSTEM) // 3]  # smoke: ~3 pages, not 9

        cross = first_turns(a, [f"x{i}" for i in range(n)], system)
        acked += [(name, 1) for name in cross]
        wait_written_behind(a)
        read_before, (wall_before, summed_before) = metric(b, "dss_remote_read_bytes"), read_seconds(b)
        x_warm, x_cold = second_turns(b, cross, acked)
        b_read = metric(b, "dss_remote_read_bytes") - read_before
        wall_after, summed_after = read_seconds(b)
        b_seconds, b_summed = wall_after - wall_before, summed_after - summed_before
        mbps = b_read / 1e6 / b_seconds if b_seconds > 0 else 0.0
        mbps_summed = b_read / 1e6 / b_summed if b_summed > 0 else 0.0

        fail = first_turns(a, [f"f{i}" for i in range(n)], system)
        acked += [(name, 1) for name in fail]
        wait_written_behind(a)
        assert a.proc is not None
        os.kill(a.proc.pid, signal.SIGKILL)
        a.proc.wait(30)
        a.proc = None
        f_warm, f_cold = second_turns(b, fail, acked)

        lost = 0
        with httpx.Client(base_url=b.base_url, timeout=30) as c:
            for name, version in acked:
                r = c.get(f"/v1/sessions/{name}/versions/{version}", headers=b.headers(f"u-{name}"))
                lost += r.status_code != 200
        ceiling_mbps, n_keys = redis_ceiling_mbps(prefix)

        a.start()  # catches up on what it missed
        with httpx.Client(base_url=a.base_url, headers=a.headers("admin", True), timeout=60) as c:
            t0 = time.perf_counter()
            receipt = c.delete(f"/v1/users/u-{next(iter(cross))}").json()
            erase_s = time.perf_counter() - t0
        fleet = receipt.get("fleet") or {}

        def med(xs: list[float]) -> float:
            return statistics.median(xs)

        x_ratio = med(x_warm) / med(x_cold)
        f_ratio = med(f_warm) / med(f_cold)
        print(
            f"cross-server turn 2 TTFT p50 {med(x_warm) * 1e3:.0f} ms vs cold {med(x_cold) * 1e3:.0f} ms "
            f"(B read {b_read / 1e6:.1f} MB from Redis)"
        )
        print(
            f"after kill -9 of A: turn 2 TTFT p50 {med(f_warm) * 1e3:.0f} ms "
            f"vs cold {med(f_cold) * 1e3:.0f} ms"
        )
        for form, done in routes.items():
            print(f"routed by {form}: each session's servers {done}: {'held' if held[form] else 'MOVED'}")
        print(
            f"B's remote reads {mbps:.0f} MB/s ({mbps_summed:.0f} MB/s over the phases' seconds summed "
            f"over reader threads); plain pipelined GETs of the {n_keys} pages at rest "
            f"{ceiling_mbps:.0f} MB/s (Redis's ceiling here); "
            f"acknowledged versions {len(acked)}, lost {lost}"
        )
        print(
            f"fleet erase {erase_s:.2f} s: servers {sorted((fleet.get('servers') or {}).keys())}, "
            f"unanswered {fleet.get('unanswered')}, "
            f"remnants {receipt.get('verification', {}).get('remnants')}"
        )
        print(
            f"RESULT cross_server_ttft_vs_cold={x_ratio:.3f} failover_ttft_vs_cold={f_ratio:.3f} "
            f"remote_load_mbps={mbps:.0f} redis_ceiling_mbps={ceiling_mbps:.0f} "
            f"routed_to_holder={routed:.3f} lost={lost} lost_versions={lost} "
            f"erase_fleet_s={erase_s:.3f} warmup_stalls={stalls}",
            flush=True,
        )
    except BaseException:
        for name, s in servers.items():  # what each server said, before the logs are removed
            print(f"--- server {name}'s log ---\n{s.log_tail(40)}", file=sys.stderr)
        raise
    finally:
        if router is not None:
            router.stop()
        for s in servers.values():
            s.stop()
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(f"{prefix}*"))
        if keys:
            client.delete(*keys)
        drop_database(admin, db_name)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
