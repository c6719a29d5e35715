"""Rollback latency while the metadata database is busy with other writers, without an engine.

The database side of `bench/api_load.py`'s load on a SQLite file: `--committers` threads commit
chat-turn-sized versions (600 token ids, a few messages) to their own sessions with a short pause
between turns, one thread stands in for the disk writer's page rows (small inserts through the
relaxed engine, back to back), and `--rollbackers` threads roll their own sessions back and
measure each call. Reports rollback p50/p99/max and the other writers' throughput (goal:
`rollback_p99_ms` <= 20 while they keep going). `--history N`: each rollbacker's session holds N
versions, and each rollback moves its head one version back from a new one (committed before,
not timed) instead of onto itself: what a long session costs a rollback.

Run: `.venv/bin/python bench/rollback_contention.py [--seconds 20] [--history N] [--smoke]`
(idle: `--committers 0`).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from sqlalchemy import text

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))  # after PYTHONPATH, so that another checkout can be measured

from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, upgrade_to_head  # noqa: E402
from dss.dialogue.versions import VersionStore  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--committers", type=int, default=8)
    ap.add_argument("--rollbackers", type=int, default=4)
    ap.add_argument("--history", type=int, default=0, help="versions a rollbacker's session holds (0: 3)")
    ap.add_argument("--smoke", action="store_true", help="2 s, for the suite")
    args = ap.parse_args()
    seconds = 2.0 if args.smoke else args.seconds
    with tempfile.TemporaryDirectory() as tmp:
        url = sqlite_url_for(Path(tmp))
        upgrade_to_head(url)
        engine, relaxed = make_engine(url), make_engine(url, durable_commits=False)
        try:
            with engine.begin() as conn:
                conn.execute(text("CREATE TABLE filler (x BLOB)"))
            store = VersionStore(make_session_factory(engine))
            stop = threading.Event()
            commits = [0] * args.committers
            rows = [0]
            took: list[float] = []
            ready = threading.Semaphore(0)
            failures: list[str] = []

            def turn(i: int) -> None:
                sid = f"turns-{i}"
                store.create_session("u", sid)
                rng = random.Random(i)
                messages: list[dict[str, str]] = []
                while not stop.is_set():
                    messages = [*messages[-6:], {"role": "user", "content": "Where are the nails?" * 5}]
                    tokens = list(range(600 + len(messages)))
                    store.commit("u", sid, tokens=tokens, messages=messages)
                    commits[i] += 1
                    time.sleep(rng.uniform(0.005, 0.03))

            def page_rows() -> None:
                while not stop.is_set():
                    with relaxed.begin() as conn:
                        conn.execute(text("INSERT INTO filler VALUES (:b)"), {"b": b"x" * 200})
                    rows[0] += 1
                    time.sleep(0.001)

            def rollbacker(i: int) -> None:
                sid = f"rollbacks-{i}"
                store.create_session("u", sid)
                kept = max(3, args.history)
                for n in range(kept):
                    store.commit("u", sid, tokens=[1, 2, n], messages=[{"role": "user", "content": str(n)}])
                rng = random.Random(100 + i)
                ready.release()
                while not stop.is_set():
                    head = kept
                    if args.history:
                        message = {"role": "user", "content": "x"}
                        head = store.commit("u", sid, tokens=[1, 2], messages=[message]).number
                    start = time.perf_counter()
                    try:
                        store.rollback("u", sid, "main", kept, expected_head=head)
                    except Exception as exc:
                        failures.append(type(exc).__name__)
                    took.append(time.perf_counter() - start)
                    time.sleep(rng.uniform(0.01, 0.05))

            threads = [threading.Thread(target=turn, args=(i,)) for i in range(args.committers)]
            threads += [threading.Thread(target=page_rows)]
            threads += [threading.Thread(target=rollbacker, args=(i,)) for i in range(args.rollbackers)]
            for t in threads:
                t.start()
            for _ in range(args.rollbackers):  # their sessions made (`--history`: may take a while)
                ready.acquire()
            time.sleep(seconds)
            stop.set()
            for t in threads:
                t.join()
        finally:
            engine.dispose()
            relaxed.dispose()
    ms = np.array(took) * 1000
    p50, p99 = np.percentile(ms, [50, 99])
    print(
        f"RESULT rollbacks={len(ms)} rollback_p50_ms={p50:.1f} rollback_p99_ms={p99:.1f} "
        f"rollback_max_ms={ms.max():.1f} commits_per_s={sum(commits) / seconds:.0f} "
        f"page_rows_per_s={rows[0] / seconds:.0f} errors={len(failures)}"
    )


if __name__ == "__main__":
    main()
