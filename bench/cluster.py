"""Two DSS servers sharing one PostgreSQL, one Redis page tier and one master key, measured side
by side in one run (real vLLM engines on the default model, HTTP on loopback, streamed, greedy):

- `cross_server_ttft_vs_cold`: a session's turn 1 runs on server A; its turn 2 runs on server B,
  which never saw the session and loads its KV from Redis. Its TTFT over the TTFT of the same
  request sent cold (another user, so nothing of it is cached anywhere) to B, interleaved.
  Goal <= 0.3.
- `failover_ttft_vs_cold`: the same right after A was killed with `kill -9` (its sessions' turn 1
  ran on A just before; B continues them).
- `remote_load_mbps`: MB/s of page bytes at rest read from Redis (GET of every page this run
  stored, one after another, as a promotion reads them).
- `lost_versions`: versions a client got a `state_version` for that B cannot list after the
  failover (goal 0).
- `erase_fleet_s`: `DELETE /v1/users/{id}` on A (restarted after the failover) until its receipt
  came back with B's acknowledgement.

    .venv/bin/python bench/cluster.py                 # ~4 min on 2 cores
    .venv/bin/python bench/cluster.py --sessions 2    # quicker

Needs PostgreSQL (`DSS_TEST_PG_URL`, default the local `test` server; a fresh database is made and
dropped) and Redis (`DSS_TEST_REDIS_URL`, keys under a fresh prefix, removed at the end).
The last line is `RESULT cross_server_ttft_vs_cold= failover_ttft_vs_cold= remote_load_mbps=
lost_versions= erase_fleet_s=`.
"""

from __future__ import annotations

import argparse
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
from engine_patch.setup.model import NOT_PREPARED  # noqa: E402 - after the path is set
from tests.api_server import ApiServer, model_dir  # noqa: E402 - after the path is set

PG_URL = os.environ.get("DSS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("DSS_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
SYSTEM = " ".join(f"Rule {i}: answer in one short sentence, politely, without lists." for i in range(110))
QUESTIONS = ("Name a river.", "Name a mountain.", "Name a lake.", "Name a forest.", "Name a desert.")


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
    server: ApiServer, user: str, messages: list[dict[str, str]], sid: str | None
) -> dict[str, Any]:
    """One streamed chat turn: TTFT (first chunk with content), its text, its version."""
    body: dict[str, Any] = {"messages": messages, "max_tokens": 12, "temperature": 0, "stream": True}
    if sid is not None:
        body["session_id"] = sid
    text, version, ttft = "", None, None
    t0 = time.perf_counter()
    with (
        httpx.Client(base_url=server.base_url, headers=server.headers(user), timeout=300) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
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


def remote_load_mbps(prefix: str) -> tuple[float, int]:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{prefix}p:*"))
    t0 = time.perf_counter()
    total = sum(len(client.get(k) or b"") for k in keys)
    dt = time.perf_counter() - t0
    return (total / 1e6 / dt if dt > 0 else 0.0), len(keys)


def first_turns(a: ApiServer, names: list[str]) -> dict[str, list[dict[str, str]]]:
    """Turn 1 of each session on A; returns each session's history."""
    histories: dict[str, list[dict[str, str]]] = {}
    for i, name in enumerate(names):
        msgs = [
            {"role": "system", "content": SYSTEM},
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=4, help="sessions per phase (cross-server, failover)")
    args = ap.parse_args()
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
    a = ApiServer(model, root / "a", env={**env, "DSS_STORE__SERVER_ID": "a"})
    b = ApiServer(model, root / "b", env={**env, "DSS_STORE__SERVER_ID": "b"})
    try:
        a.launch()
        b.launch()
        a.wait_ready()
        b.wait_ready()
        for s in (a, b):  # one throwaway request each
            streamed_turn(s, "warmup", [{"role": "user", "content": "Hi."}], None)
        n = args.sessions
        acked: list[tuple[str, int]] = []

        cross = first_turns(a, [f"x{i}" for i in range(n)])
        acked += [(name, 1) for name in cross]
        wait_written_behind(a)
        read_before = metric(b, "dss_remote_read_bytes")
        x_warm, x_cold = second_turns(b, cross, acked)
        b_read = metric(b, "dss_remote_read_bytes") - read_before

        fail = first_turns(a, [f"f{i}" for i in range(n)])
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
        mbps, n_keys = remote_load_mbps(prefix)

        a.start()  # catches up on what it missed
        t0 = time.perf_counter()
        with httpx.Client(base_url=a.base_url, headers=a.headers("admin", True), timeout=60) as c:
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
        print(
            f"Redis GET of {n_keys} pages at rest: {mbps:.0f} MB/s; "
            f"acknowledged versions {len(acked)}, lost {lost}"
        )
        print(
            f"fleet erase {erase_s:.2f} s: servers {sorted((fleet.get('servers') or {}).keys())}, "
            f"unanswered {fleet.get('unanswered')}, "
            f"remnants {receipt.get('verification', {}).get('remnants')}"
        )
        print(
            f"RESULT cross_server_ttft_vs_cold={x_ratio:.3f} failover_ttft_vs_cold={f_ratio:.3f} "
            f"remote_load_mbps={mbps:.0f} lost_versions={lost} erase_fleet_s={erase_s:.3f}",
            flush=True,
        )
    finally:
        for s in (a, b):
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
