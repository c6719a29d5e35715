"""Memory one request takes against a user's long history (issue 19, item 13): deleting one
session, listing the sessions (their `stored_bytes`) and listing one session's versions, for a
user with 40 sessions x 25 versions x 16k tokens (64 KiB of token ids a version, 62.5 MiB in all),
written straight into the store (no engine); the KV of each version's first 4 pages is stored.

Peaks are tracemalloc's (Python objects, numpy buffers and the driver's bytes; not SQLite's own
page cache), above what was allocated before the request. The listings run through the app
(FastAPI's test client, in this process). `--sessions/--versions/--tokens` scale the shape.

    python bench/history_memory.py [--sessions 40 --versions 25 --tokens 16384]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import load_settings
from dss.namespace import ModelFingerprint
from dss.store import Store
from tests.db_helpers import count_user_rows
from tests.store_helpers import put_sequence

FP = ModelFingerprint(
    model_id="bench", revision="1", dtype="bfloat16", num_layers=1, num_kv_heads=1, head_size=8, block_size=16
)
USER = "history-bench-user"
MiB = 1 << 20


def peak_mb(fn: Callable[[], Any]) -> float:
    """The peak MiB `fn()` allocates above what was allocated when it started."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        fn()
        return (tracemalloc.get_traced_memory()[1] - base) / MiB
    finally:
        tracemalloc.stop()


def seconds(*runs: Callable[[], Any]) -> float:
    """The best wall time of these runs, untraced (tracemalloc slows every allocation; the best
    of several is the least disturbed by other load on the machine)."""
    best = float("inf")
    for fn in runs:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def fill(store: Store, sessions: int, versions: int, n_tokens: int) -> None:
    """Every session starts with the same 2 pages (a system prompt) and then its own tokens; a
    version is its session's stem with its own last 512 tokens (a regenerated turn)."""
    fid = store.fingerprints.register(FP)
    tenant = store.identity.tenant_for(USER)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 50_000, 2 * FP.block_size, dtype=np.int32)
    page = rng.integers(0, 255, FP.page_nbytes, dtype=np.uint8).tobytes()
    tail = min(512, n_tokens - len(shared))
    for s in range(sessions):
        sid = f"s{s:03d}"
        store.versions.create_session(USER, sid)
        stem = np.concatenate(
            [shared, rng.integers(0, 50_000, n_tokens - len(shared) - tail, dtype=np.int32)]
        )
        for v in range(versions):
            tokens = np.concatenate([stem, rng.integers(0, 50_000, tail, dtype=np.int32)])
            msgs = [{"role": "user", "content": f"turn {v} " + "x" * 200}]
            store.versions.commit(USER, sid, tokens=tokens, messages=msgs, fingerprint=fid)
            head = tokens[: 4 * FP.block_size]
            put_sequence(store, fid, tenant, head, [page] * 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=40)  # at least 5: 4 are deleted
    ap.add_argument("--versions", type=int, default=25)
    ap.add_argument("--tokens", type=int, default=16_384)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (the suite runs this)")
    args = ap.parse_args()
    if args.smoke:
        args.sessions, args.versions, args.tokens = 5, 3, 512
    history_mb = args.sessions * args.versions * args.tokens * 4 / MiB
    print(f"cores={os.cpu_count()} sessions={args.sessions} versions={args.versions} tokens={args.tokens}")
    with tempfile.TemporaryDirectory() as d:
        settings = load_settings(
            store={"data_dir": Path(d), "fsync": False, "host_capacity_bytes": 256 << 20},
            engine={"enabled": False},
            auth={"dev_mode": True, "dev_allowed_hosts": ["testserver"]},
        )
        with TestClient(create_app(settings)) as c:
            while c.get("/readyz").status_code != 200:
                time.sleep(0.05)
            store: Store = c.app.state.dss.store  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            fill(store, args.sessions, args.versions, args.tokens)
            print(f"fill_s={time.perf_counter() - t0:.1f} history_token_ids_mb={history_mb:.1f}")
            h = {"X-DSS-User": USER}

            def list_sessions() -> None:
                r = c.get("/v1/sessions?limit=100", headers=h)
                assert r.status_code == 200 and len(r.json()["data"]) >= args.sessions - 4, r.text
                assert all(s["stored_bytes"] > 0 for s in r.json()["data"])

            def list_versions() -> None:
                r = c.get("/v1/sessions/s001/versions", headers=h)
                assert r.status_code == 200 and len(r.json()["data"]) == min(args.versions, 100), r.text

            def delete_session(sid: str) -> Callable[[], None]:
                return lambda: c.delete(f"/v1/sessions/{sid}", headers=h).raise_for_status() and None

            list_sessions()  # warm: SQL compilation caches, imports
            list_versions()
            sessions_mb, sessions_s = peak_mb(list_sessions), seconds(*[list_sessions] * 5)
            versions_mb, versions_s = peak_mb(list_versions), seconds(*[list_versions] * 5)
            delete_mb = peak_mb(delete_session("s000"))
            delete_s = seconds(*(delete_session(f"s{i:03d}") for i in (2, 3, 4)))
            assert count_user_rows(store.sf, USER)["sessions"] == args.sessions - 4
    print(
        f"delete_session_s={delete_s:.3f} list_sessions_s={sessions_s:.3f} list_versions_s={versions_s:.3f}"
    )
    print(
        f"RESULT delete_session_peak_mb={delete_mb:.2f} list_sessions_peak_mb={sessions_mb:.2f} "
        f"list_versions_peak_mb={versions_mb:.2f} history_mb={history_mb:.1f}"
    )


if __name__ == "__main__":
    main()
