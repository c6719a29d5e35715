"""A rollback waits for nothing that is not its own (issue 31): on a SQLite file that other
writers of the process keep locked back to back (chat turns' version commits, page rows), a
rollback waits for at most the one writer inside, not for a queue of them nor for SQLite's busy
handler to wake from its sleep (`dss.db.write_gate`). On the old code the rollback polled
(1, 2, 5, ... 100 ms sleeps) and lost the lock to the next writer again and again."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sqlalchemy import text

from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, upgrade_to_head
from dss.dialogue.versions import VersionStore

HOLD_S = 0.015  # how long each other writer holds the write lock
WRITERS = 3


def test_a_rollback_waits_for_one_writer_at_most(tmp_path: Path) -> None:
    url = sqlite_url_for(tmp_path)
    upgrade_to_head(url)
    engine, relaxed = make_engine(url), make_engine(url, durable_commits=False)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE filler (x INTEGER)"))
        store = VersionStore(make_session_factory(engine))
        store.create_session("alice", "s")
        for n in range(3):
            store.commit("alice", "s", tokens=[1, 2, n], messages=[{"role": "user", "content": str(n)}])
        stop = threading.Event()

        def writer(eng: object) -> None:
            while not stop.is_set():
                with relaxed.begin() as conn:
                    conn.execute(text("INSERT INTO filler VALUES (1)"))  # takes the write lock
                    time.sleep(HOLD_S)

        threads = [threading.Thread(target=writer, args=(relaxed,)) for _ in range(WRITERS)]
        for t in threads:
            t.start()
        took: list[float] = []
        try:
            time.sleep(0.1)
            for _ in range(25):
                start = time.perf_counter()
                store.rollback("alice", "s", "main", 3, expected_head=3)
                took.append(time.perf_counter() - start)
                time.sleep(0.01)
        finally:
            stop.set()
            for t in threads:
                t.join()
        took.sort()
        # One writer's hold plus the rollback's own transaction (about 20 ms), with room for a
        # machine shared with other jobs; polling behind three writers, one rollback of the old
        # code waited the whole busy timeout (5 s) and failed with `database is locked`.
        assert took[-2] < 0.25, [round(t * 1000, 1) for t in took]
    finally:
        engine.dispose()
        relaxed.dispose()
