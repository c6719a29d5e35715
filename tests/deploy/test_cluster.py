"""Two real `dss serve` processes (real vLLM engines on the default model) sharing one PostgreSQL
database, one Redis page tier and one master key, each with its own data directory: a session
started on A continues on B with its KV from Redis, concurrent turns from both on one head lose
no version, an erasure on A leaves nothing on B, in Redis or in the database, a reply means its
pages are in Redis (A frozen right after it: B loads all of them), and after `kill -9` of A its
sessions continue on B. (Routing through HAProxy: tests/deploy/test_router.py.)
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from sqlalchemy import func, select

from tests.api_server import ApiServer, chat, model_dir, user_msg
from tests.dss.pages.test_tier_remote import REDIS_URL, _redis_answers

pytestmark = pytest.mark.skipif(not _redis_answers(REDIS_URL), reason=f"no Redis answers at {REDIS_URL}")

# A long first turn: its KV spans several pages, so where it comes from shows in the timings.
SYSTEM = {"role": "system", "content": " ".join(f"Rule {i}: answer briefly and politely." for i in range(60))}


class Cluster:
    def __init__(self, root: Path, db_url: str, prefix: str) -> None:
        model = model_dir()
        assert model is not None
        env = {
            "DSS_STORE__DB_URL": db_url,
            "DSS_MASTER_KEY": secrets.token_hex(32),
            "DSS_STORE__REMOTE_URL": REDIS_URL,
            "DSS_STORE__REMOTE_KEY_PREFIX": prefix,
        }
        self.prefix = prefix
        self.a = ApiServer(model, root / "a", env={**env, "DSS_STORE__SERVER_ID": "a"})
        self.b = ApiServer(model, root / "b", env={**env, "DSS_STORE__SERVER_ID": "b"})

    def start(self) -> None:
        """Both at once (each engine takes most of a minute to start)."""
        self.a.launch()
        self.b.launch()
        self.a.wait_ready()
        self.b.wait_ready()

    def stop(self) -> None:
        self.a.stop()
        self.b.stop()

    def client(self, server: ApiServer, user: str) -> httpx.Client:
        # Each server makes its own key for the user, in the shared database: both keys work on both.
        return httpx.Client(base_url=server.base_url, headers=server.headers(user), timeout=180.0)

    def admin(self, server: ApiServer) -> httpx.Client:
        return httpx.Client(base_url=server.base_url, headers=server.headers("admin", True), timeout=180.0)


def wait_written_behind(server: ApiServer, timeout_s: float = 60.0) -> None:
    """Until the server's saves landed and its writer drained (its pages reached disk and Redis).
    A turn's answer can return before the engine copied its last (tail) page: the save is planned
    when the request finishes and published after the worker's copy, so both gauges must be 0."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=server.base_url, headers=server.headers("admin", True), timeout=10) as c:
        while time.monotonic() < deadline:
            gauges = {
                line.split()[0]: float(line.split()[-1])
                for line in c.get("/metrics").text.splitlines()
                if line.startswith(("dss_disk_write_backlog", "dss_pending_saves"))
            }
            if gauges.get("dss_disk_write_backlog", 1.0) == 0 and gauges.get("dss_pending_saves", 1.0) == 0:
                return
            time.sleep(0.2)
    raise AssertionError("the writer did not drain")


@pytest.fixture(scope="module")
def cluster(module_pg_url: str) -> Iterator[Cluster]:
    if model_dir() is None:
        pytest.skip("the default model is not prepared (make model)")
    root = Path(tempfile.mkdtemp(prefix="dss-cluster-test-"))
    prefix = f"cluster-{uuid.uuid4().hex[:8]}:"
    c = Cluster(root, module_pg_url, prefix)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(f"{prefix}*"))
        if keys:
            client.delete(*keys)
        shutil.rmtree(root, ignore_errors=True)


def turn(client: httpx.Client, sid: str, history: list[dict[str, Any]], text: str) -> dict[str, Any]:
    messages = [*history, user_msg(text)]
    r = chat(client, messages, session_id=sid)
    history[:] = [*messages, {"role": "assistant", "content": r["choices"][0]["message"]["content"]}]
    return r


def test_a_session_started_on_a_continues_on_b_with_kv_from_redis(cluster: Cluster) -> None:
    history: list[dict[str, Any]] = [SYSTEM]
    with cluster.client(cluster.a, "cl-ann") as on_a, cluster.client(cluster.b, "cl-ann") as on_b:
        r1 = turn(on_a, "trip", history, "Name a city in France.")
        assert r1["state_version"] == 1
        assert r1["usage"]["prompt_tokens"] > 3 * 128
        wait_written_behind(cluster.a)
        r2 = turn(on_b, "trip", history, "And one in Spain?")
        assert r2["state_version"] == 2 and r2["parent_version"] == 1 and r2["branch"] == "main"
        dss = r2["dss"]
        # B never saw the session: all but the last few tokens come from the remote tier.
        assert dss["loaded_from"]["remote"] >= r1["usage"]["prompt_tokens"] - 128, json.dumps(dss)
        assert dss["cached_tokens"] >= r1["usage"]["prompt_tokens"], dss
        # And back on A, which continues from B's version.
        r3 = turn(on_a, "trip", history, "And one in Italy?")
        assert r3["state_version"] == 3 and r3["parent_version"] == 2


def test_concurrent_turns_on_one_head_from_both_servers_lose_no_version(cluster: Cluster) -> None:
    history: list[dict[str, Any]] = [SYSTEM]
    with cluster.client(cluster.a, "cl-bo") as on_a, cluster.client(cluster.b, "cl-bo") as on_b:
        turn(on_a, "race", history, "Say hello.")
        results: dict[str, dict[str, Any]] = {}
        messages = [*history, user_msg("Say goodbye.")]

        def send(name: str, client: httpx.Client) -> None:
            r = client.post(
                "/v1/chat/completions",
                json={"messages": messages, "session_id": "race", "max_tokens": 16, "temperature": 0},
            )
            results[name] = {"status": r.status_code, **(r.json() if r.status_code == 200 else {})}

        threads = [threading.Thread(target=send, args=a) for a in (("a", on_a), ("b", on_b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert {r["status"] for r in results.values()} <= {200, 409}, results
        won = [r for r in results.values() if r["status"] == 200]
        assert won, results
        # One extends main; another that also succeeded went to a fork of version 1.
        assert {(r["parent_version"]) for r in won} == {1}
        assert len({r["state_version"] for r in won}) == len(won)
        listed = on_b.get("/v1/sessions/race/versions").json()["data"]
        numbers = {v["number"] for v in listed}
        assert {1, *(r["state_version"] for r in won)} <= numbers, listed


def test_erasing_on_a_leaves_nothing_on_b_in_redis_or_the_database(
    cluster: Cluster, module_pg_url: str
) -> None:
    import redis

    history: list[dict[str, Any]] = [SYSTEM]
    with cluster.client(cluster.a, "cl-cy") as on_a, cluster.client(cluster.b, "cl-cy") as on_b:
        turn(on_a, "gone", history, "Name a colour.")
        wait_written_behind(cluster.a)
        turn(on_b, "gone", history, "Name another.")  # B now holds pages of the user too
        wait_written_behind(cluster.b)
    client = redis.Redis.from_url(REDIS_URL)
    # A tenant's pages are in one set per bucket (`{prefix}{bN}t:<tenant>`, dss.pages.tiers.remote).
    tenant_sets = {k.decode().rpartition("t:")[2] for k in client.scan_iter(f"{cluster.prefix}*t:*")}
    with cluster.admin(cluster.a) as admin_a:
        r = admin_a.delete("/v1/users/cl-cy")
    assert r.status_code == 200, r.text
    receipt = r.json()
    tenant = receipt["subject"]
    assert tenant in tenant_sets  # the user had pages in Redis
    assert receipt["verification"]["remnants"] == 0, receipt["verification"]
    fleet = receipt.get("fleet") or {}
    assert "b" in (fleet.get("servers") or {}), receipt
    assert not fleet.get("unanswered"), receipt
    assert not any(client.scard(k) for k in client.scan_iter(f"{cluster.prefix}*t:{tenant}"))
    # Nothing of the user in the shared database.
    from dss.db import models as m
    from dss.db.connect import make_engine, make_session_factory

    engine = make_engine(module_pg_url)
    try:
        with make_session_factory(engine)() as s:
            assert (
                s.execute(
                    select(func.count()).select_from(m.PageRow).where(m.PageRow.tenant == tenant)
                ).scalar_one()
                == 0
            )
            assert (
                s.execute(
                    select(func.count()).select_from(m.SessionRow).where(m.SessionRow.user_id == "cl-cy")
                ).scalar_one()
                == 0
            )
    finally:
        engine.dispose()
    # B verifies too (its own tiers): clean; and B's next turn of the user starts cold.
    with cluster.admin(cluster.b) as admin_b:
        v = admin_b.get(f"/v1/erasures/{receipt['id']}").json()
    assert v["verification"]["remnants"] == 0, v
    with cluster.client(cluster.b, "cl-cy") as on_b:
        again = chat(on_b, [SYSTEM, user_msg("Name a colour.")], session_id="gone")
    assert again["state_version"] == 1 and again["dss"]["loaded_tokens"] == 0, json.dumps(again["dss"])


def test_a_reply_means_its_pages_are_in_the_shared_tier(cluster: Cluster) -> None:
    """Turn N is durable before turn N+1 looks: the moment A's reply arrives, A is frozen (SIGSTOP
    stops its writer too, as a `kill -9` would); B, which never saw the session, loads every
    whole page of it from Redis. (A one-token answer: A replies right after the prefill, when
    its save has only just been planned; a long prompt: its pages take the writer a while.)"""
    rules = " ".join(f"Rule {i}: answer briefly, politely and in plain words." for i in range(110))
    messages = [{"role": "system", "content": rules}, user_msg("Name a planet of the solar system.")]
    with cluster.client(cluster.a, "cl-fr") as on_a, cluster.client(cluster.b, "cl-fr") as on_b:
        r1 = chat(on_a, messages, session_id="frozen", max_tokens=1)
        assert cluster.a.proc is not None
        pid = cluster.a.proc.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            history = [*messages, {"role": "assistant", "content": r1["choices"][0]["message"]["content"]}]
            r2 = turn(on_b, "frozen", history, "And one of its moons?")
        finally:
            os.kill(pid, signal.SIGCONT)
    assert r2["parent_version"] == 1
    whole_pages = r1["usage"]["prompt_tokens"] // 128 * 128
    assert whole_pages >= 10 * 128
    assert r2["dss"]["loaded_from"]["remote"] >= whole_pages, json.dumps(r2["dss"])


def test_kill_9_of_a_mid_conversation_continues_on_b(cluster: Cluster) -> None:
    history: list[dict[str, Any]] = [SYSTEM]
    with cluster.client(cluster.a, "cl-di") as on_a:
        for i, q in enumerate(("Name a fruit.", "Name a vegetable.", "Name a grain.")):
            r = turn(on_a, "long", history, q)
            assert r["state_version"] == i + 1
        wait_written_behind(cluster.a)
        # A fourth turn is being generated when A dies: it was never acknowledged.
        body = {
            "messages": [*history, user_msg("Tell a long story.")],
            "session_id": "long",
            "max_tokens": 400,
        }
        with on_a.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data:"):
                    break
            assert cluster.a.proc is not None
            engine = psutil.Process(cluster.a.proc.pid).children(recursive=True)  # core + worker
            assert engine, "A runs its engine in child processes"
            os.kill(cluster.a.proc.pid, signal.SIGKILL)
    cluster.a.proc.wait(30)
    cluster.a.proc = None
    # Its engine processes end with it (engine_patch.connector.orphan_guard), not holding memory and cores.
    _, left = psutil.wait_procs(engine, timeout=15)
    assert not left, f"A's engine processes outlived it: {left}"
    # (The module's last test: A stays down. Its catch-up after a restart: tests/dss/fleet/test_fleet.py.)
    with cluster.client(cluster.b, "cl-di") as on_b:
        r = turn(on_b, "long", history, "Name a nut.")
        assert r["state_version"] == 4 and r["parent_version"] == 3  # nothing acknowledged was lost
        assert r["dss"]["loaded_from"]["remote"] > 0, json.dumps(r["dss"])
