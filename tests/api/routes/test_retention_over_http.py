"""Retention hints and warm-up over HTTP, on a real `dss serve`: `PATCH /v1/sessions/{id}` and
`POST /v1/sessions/{id}/warm`.

Most tests run a server without an engine (`--no-engine`) on a data directory whose sessions and
pages were stored first through a `Store` (as turns leave them), so the pages are on disk only when
the server starts, like after a restart. One test drives the real engine (skipped without the
default model).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from dss.config import StoreConfig
from dss.store import Store
from tests.api_server import ApiServer, chat, get_server, model_dir, user_msg
from tests.store_helpers import SMALL_FP, pages_for, put_sequence

BS = SMALL_FP.block_size
TRIP = np.arange(1, 1 + 3 * BS, dtype=np.int32)  # 3 pages
BIG = np.arange(1000, 1000 + 3 * BS, dtype=np.int32)


def _seed(data_dir: Path) -> None:
    """alice's sessions "trip" (3 pages) and "big" (3 pages) and "empty", stored on disk."""
    cfg = StoreConfig(data_dir=data_dir, fsync=False, host_capacity_bytes=1 << 22, codec_process=False)
    with Store.open(cfg) as store:
        fid = store.fingerprints.register(SMALL_FP)
        tenant = store.identity.tenant_for("alice")
        for sid, tokens in (("trip", TRIP), ("big", BIG)):
            store.versions.create_session("alice", sid)
            store.versions.commit(
                "alice", sid, tokens=tokens, messages=[{"role": "user", "content": sid}], fingerprint=fid
            )
            put_sequence(store, fid, tenant, tokens, pages_for(SMALL_FP, tokens))
        store.versions.create_session("alice", "empty")
        store.flush()


@pytest.fixture(scope="module")
def server() -> Iterator[ApiServer]:
    root = Path(tempfile.mkdtemp(prefix="dss-api-retention-"))
    srv = ApiServer(
        None,
        root,
        env={
            "DSS_STORE__HOST_CAPACITY_BYTES": str(1 << 20),
            # 1 MiB * 0.002: 4 pages of SMALL_FP may be pinned per user.
            "DSS_STORE__RETENTION__PINNED_USER_FRACTION": "0.002",
            "DSS_STORE__RETENTION__SWEEP_INTERVAL_S": "0.1",
        },
    )
    _seed(srv.data_dir)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def alice(server: ApiServer) -> Iterator[httpx.Client]:
    with server.client("alice", timeout=30) as c:
        yield c


def resident(c: httpx.Client, sid: str, version: int = 1) -> dict[str, int]:
    r = c.get(f"/v1/sessions/{sid}/versions/{version}")
    assert r.status_code == 200, r.text
    out: dict[str, int] = r.json()["resident"]
    return out


def wait_for(cond: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_patch_round_trips_and_persists(alice: httpx.Client, server: ApiServer) -> None:
    r = alice.get("/v1/sessions/empty")
    assert (r.json()["kv_retention"], r.json()["kv_idle_ttl_s"]) == ("normal", None)
    r = alice.patch("/v1/sessions/empty", json={"kv_retention": "evict", "kv_idle_ttl_s": 120})
    assert r.status_code == 200, r.text
    assert (r.json()["kv_retention"], r.json()["kv_idle_ttl_s"], r.json()["object"]) == (
        "evict",
        120,
        "session",
    )
    r = alice.patch("/v1/sessions/empty", json={"kv_retention": "normal"})  # the TTL stays
    assert (r.json()["kv_retention"], r.json()["kv_idle_ttl_s"]) == ("normal", 120)
    r = alice.patch("/v1/sessions/empty", json={"kv_idle_ttl_s": None})  # null clears it
    assert (r.json()["kv_retention"], r.json()["kv_idle_ttl_s"]) == ("normal", None)
    alice.patch("/v1/sessions/empty", json={"kv_idle_ttl_s": 3600})
    listed = {s["id"]: s for s in alice.get("/v1/sessions").json()["data"]}
    assert listed["empty"]["kv_idle_ttl_s"] == 3600
    server.restart()
    r = alice.get("/v1/sessions/empty")
    assert (r.json()["kv_retention"], r.json()["kv_idle_ttl_s"]) == ("normal", 3600)
    alice.patch("/v1/sessions/empty", json={"kv_idle_ttl_s": None})


@pytest.mark.parametrize(
    "body",
    [
        {"kv_retention": "forever"},
        {"kv_retention": 3},
        {"kv_idle_ttl_s": 0},
        {"kv_idle_ttl_s": -5},
        {"kv_idle_ttl_s": 10**9},
        {"kv_idle_ttl_s": "soon"},
    ],
)
def test_bad_values_are_400_and_change_nothing(alice: httpx.Client, body: dict[str, Any]) -> None:
    r = alice.patch("/v1/sessions/empty", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] in ("kv_retention", "kv_idle_ttl_s")
    s = alice.get("/v1/sessions/empty").json()
    assert (s["kv_retention"], s["kv_idle_ttl_s"]) == ("normal", None)


def test_another_users_session_is_404(server: ApiServer) -> None:
    with server.client("bob", timeout=30) as bob:
        r = bob.patch("/v1/sessions/trip", json={"kv_retention": "evict"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        assert bob.post("/v1/sessions/trip/warm").status_code == 404


def test_warm_promotes_disk_pages_then_evict_demotes_them(alice: httpx.Client) -> None:
    assert resident(alice, "trip") == {
        "host": 0,
        "disk": 12,
        "remote": 0,
    }  # after the start: disk only
    r = alice.post("/v1/sessions/trip/warm")  # no body: the head of main
    assert r.status_code == 202, r.text
    w = r.json()
    assert (w["object"], w["session_id"], w["version"], w["pages"], w["tokens"]) == (
        "session.warm",
        "trip",
        1,
        3,
        12,
    )
    assert w["resident"] == {"host": 0, "disk": 12, "remote": 0}
    assert w["warming_pages"] + w["already_warming"] == 3
    assert wait_for(lambda: resident(alice, "trip")["host"] == 12)
    r = alice.patch("/v1/sessions/trip", json={"kv_retention": "evict"})
    assert r.status_code == 200 and r.json()["kv_retention"] == "evict"
    assert resident(alice, "trip") == {"host": 0, "disk": 12, "remote": 0}
    r = alice.post("/v1/sessions/trip/warm", json={"version": 1})
    assert r.status_code == 202 and r.json()["resident"]["host"] == 0
    assert wait_for(lambda: resident(alice, "trip")["host"] == 12)
    alice.patch("/v1/sessions/trip", json={"kv_retention": "normal"})


def test_warm_bodies(alice: httpx.Client) -> None:
    r = alice.post("/v1/sessions/empty/warm", json={"branch": "main"})
    assert r.status_code == 202 and (r.json()["version"], r.json()["pages"]) == (0, 0)
    assert alice.post("/v1/sessions/trip/warm", json={"version": 7}).status_code == 404
    assert alice.post("/v1/sessions/trip/warm", json={"branch": "nope"}).status_code == 404
    r = alice.post("/v1/sessions/trip/warm", json={"branch": "main", "version": 1})
    assert r.status_code == 400
    assert alice.post("/v1/sessions/trip/warm", json={"version": 0}).status_code == 400


def test_pinning_beyond_the_cap_is_409(alice: httpx.Client) -> None:
    r = alice.patch("/v1/sessions/trip", json={"kv_retention": "pinned"})  # 3 of 4 pages
    assert r.status_code == 200, r.text
    assert wait_for(lambda: resident(alice, "trip")["host"] == 12)  # pinned sessions are warmed
    r = alice.patch("/v1/sessions/big", json={"kv_retention": "pinned"})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "pinned_cap_exceeded"
    assert alice.get("/v1/sessions/big").json()["kv_retention"] == "normal"
    alice.patch("/v1/sessions/trip", json={"kv_retention": "normal"})
    assert alice.patch("/v1/sessions/big", json={"kv_retention": "pinned"}).status_code == 200
    alice.patch("/v1/sessions/big", json={"kv_retention": "normal"})


def test_idle_ttl_demotes_over_http(alice: httpx.Client) -> None:
    alice.post("/v1/sessions/big/warm")
    assert wait_for(lambda: resident(alice, "big")["host"] == 12)
    assert alice.patch("/v1/sessions/big", json={"kv_idle_ttl_s": 1}).status_code == 200
    assert wait_for(lambda: resident(alice, "big")["host"] == 0)
    assert resident(alice, "big")["disk"] == 12
    alice.patch("/v1/sessions/big", json={"kv_idle_ttl_s": None})


# ----------------------------------------------------------------------------------- real engine
def test_evict_and_warm_a_real_turns_pages(tmp_path: Path) -> None:
    """A turn long enough to fill pages; `evict` moves them to disk, a warm-up brings them back.
    On a server of its own: the shared one's host tier, filled by the tests before this one, can
    keep a page of the turn out of memory (seen in the full suite: 795 of 923 tokens warmed)."""
    model = model_dir()
    if model is None:
        pytest.skip("the default model is not prepared (run `make model` or set DSS_MODEL_DIR)")
    server = ApiServer(model, tmp_path / "server")
    server.start()
    try:
        _evict_and_warm(server)
    finally:
        server.stop()


def _evict_and_warm(api_server: ApiServer) -> None:
    story = " ".join(f"Day {i}: we walked to the museum number {i} and ate at cafe {i}." for i in range(40))
    with api_server.client("retention-user") as c, api_server.client("admin", admin=True) as admin:
        out = chat(c, [user_msg(story)], session_id="walks", max_tokens=4)
        v = out["state_version"]
        # The connector saves the last pages just after the answer: wait until no save is
        # pending and the pages stayed put for two seconds (a loaded machine publishes late).
        seen: list[tuple[float, dict[str, int]]] = []

        def settled() -> bool:
            now, where = time.monotonic(), resident(c, "walks", v)
            if not seen or seen[-1][1] != where:
                seen.append((now, where))
            pending = [
                float(line.split()[-1])
                for line in admin.get("/metrics").text.splitlines()
                if line.startswith("dss_pending_saves ")
            ]
            return pending == [0.0] and now - seen[-1][0] >= 2.0

        assert wait_for(settled, 30.0)
        seen_last = seen[-1][1]
        assert seen_last["host"] > 0 and seen_last["remote"] == 0
        r = c.patch("/v1/sessions/walks", json={"kv_retention": "evict"})
        assert r.status_code == 200, r.text
        # Every page of the version is now on disk and none in the host tier. (Before, most were
        # in both; the shared server's host tier, filled by the tests before this one, may have
        # demoted one already, and a tail page may have been in memory only: the split varies.)
        after = resident(c, "walks", v)
        total = after["disk"]
        assert after == {"host": 0, "disk": total, "remote": 0}
        assert total >= max(seen_last["host"], seen_last["disk"])
        w = c.post("/v1/sessions/walks/warm").json()
        assert (w["version"], w["tokens"], w["resident"]["disk"]) == (v, total, total)
        assert wait_for(lambda: resident(c, "walks", v)["host"] == total, 30.0), (
            total,
            resident(c, "walks", v),
            w,
            seen,
        )
        # The next turn still works (and loads what it can from the store).
        chat(c, [user_msg(story), {"role": "assistant", "content": out["choices"][0]["message"]["content"]},
                 user_msg("And on day 41?")], session_id="walks", max_tokens=4)  # fmt: skip


@pytest.fixture(scope="module")
def api_server() -> Iterator[ApiServer]:
    yield get_server()


def test_a_busy_retention_worker_is_503_with_retry_after() -> None:
    """`RetentionBusy` (a hint the worker did not reach in time, withdrawn) is an overload the
    client can retry, never a 500."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from api.http_errors import install_error_handlers
    from dss import errors

    app = FastAPI()
    install_error_handlers(app)

    @app.patch("/busy")
    def busy() -> None:
        raise errors.RetentionBusy("the retention worker is busy; nothing was changed, retry")

    r = TestClient(app).patch("/busy")
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "overloaded_error"
    assert r.json()["error"]["code"] == "retention_busy"
    assert "busy" in r.json()["error"]["message"]
