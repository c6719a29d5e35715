"""`dss.db.write_gate`: the queue in front of a SQLite file's write lock (issue 31)."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from dss.db.connect import make_engine, sqlite_url_for
from dss.db.write_gate import WriteGate, first_in_line


def test_a_first_in_line_writer_goes_before_earlier_waiters() -> None:
    gate = WriteGate()
    gate.acquire(1.0)
    order: list[str] = []

    def wait(name: str, first: bool) -> None:
        if first:
            with first_in_line():
                gate.acquire(5.0)
        else:
            gate.acquire(5.0)
        order.append(name)
        gate.release()

    plain = threading.Thread(target=wait, args=("plain", False))
    plain.start()
    time.sleep(0.05)
    urgent = threading.Thread(target=wait, args=("rollback", True))
    urgent.start()
    time.sleep(0.05)
    gate.release()
    plain.join()
    urgent.join()
    assert order == ["rollback", "plain"]


def test_the_gate_counts_per_thread_and_times_out_like_sqlite() -> None:
    gate = WriteGate()
    gate.acquire(1.0)
    gate.acquire(1.0)  # a second connection of the same thread passes
    gate.release()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            gate.acquire(0.05)
        except sqlite3.OperationalError as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert [str(e) for e in errors] == ["database is locked"]
    gate.release()
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1  # free again


def test_engines_of_one_file_share_the_gate_and_a_failed_write_lets_go(tmp_path: Path) -> None:
    url = sqlite_url_for(tmp_path)
    durable, relaxed = make_engine(url), make_engine(url, durable_commits=False)
    try:
        with durable.begin() as conn:
            conn.execute(text("CREATE TABLE t (x INTEGER PRIMARY KEY)"))
            conn.execute(text("INSERT INTO t VALUES (1)"))
        with pytest.raises(IntegrityError), relaxed.begin() as conn:
            conn.execute(text("INSERT INTO t VALUES (2)"))
            conn.execute(text("INSERT INTO t VALUES (1)"))
        # Held across the two engines: a writer of the other engine waits for the first's commit.
        entered = threading.Event()
        took: list[float] = []

        def writer() -> None:
            start = time.perf_counter()
            with relaxed.begin() as conn:
                conn.execute(text("INSERT INTO t VALUES (3)"))
                took.append(time.perf_counter() - start)
            entered.set()

        with durable.begin() as conn:
            conn.execute(text("INSERT INTO t VALUES (4)"))
            t = threading.Thread(target=writer)
            t.start()
            assert not entered.wait(0.2)
        t.join(5)
        assert entered.is_set() and took[0] >= 0.2
        with durable.connect() as conn:
            assert sorted(conn.execute(text("SELECT x FROM t")).scalars()) == [1, 3, 4]
    finally:
        durable.dispose()
        relaxed.dispose()
