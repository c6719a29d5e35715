"""`dss.db.write_gate`: the queue in front of a SQLite file's write lock (issue 31)."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, OperationalError

from dss.db.connect import BUSY_TIMEOUT_MS, make_engine, sqlite_url_for
from dss.db.write_gate import (
    RESERVATION_TTL_S,
    WAL_AUTOCHECKPOINT_PAGES,
    WriteGate,
    first_in_line,
    without_waiting,
    would_wait,
)


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


def test_without_waiting_a_write_behind_another_writer_is_refused_at_once(tmp_path: Path) -> None:
    """Issue 31 (rollbacks on the event loop): inside `without_waiting()` a write that would
    queue behind another writer of this process fails at once, writes nothing, and the same
    connection waits as usual afterwards."""
    url = sqlite_url_for(tmp_path)
    durable, relaxed = make_engine(url), make_engine(url, durable_commits=False)
    try:
        with durable.begin() as conn:
            conn.execute(text("CREATE TABLE t (x INTEGER PRIMARY KEY)"))
        holding, release = threading.Event(), threading.Event()

        def holder() -> None:
            with relaxed.begin() as conn:
                conn.execute(text("INSERT INTO t VALUES (1)"))
                holding.set()
                release.wait(5)

        t = threading.Thread(target=holder)
        t.start()
        assert holding.wait(5)
        start = time.perf_counter()
        with pytest.raises(OperationalError) as refused, without_waiting(), durable.begin() as conn:
            assert list(conn.execute(text("SELECT x FROM t")).scalars()) == []  # reads pass
            conn.execute(text("INSERT INTO t VALUES (2)"))
        assert time.perf_counter() - start < 0.5 and would_wait(refused.value)
        release.set()
        t.join(5)
        with without_waiting(), durable.begin() as conn:  # free now: no waiting needed
            conn.execute(text("INSERT INTO t VALUES (3)"))
        with durable.connect() as conn:
            assert sorted(conn.execute(text("SELECT x FROM t")).scalars()) == [1, 3]
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == BUSY_TIMEOUT_MS
            assert conn.execute(text("PRAGMA wal_autocheckpoint")).scalar() == WAL_AUTOCHECKPOINT_PAGES
    finally:
        durable.dispose()
        relaxed.dispose()


def test_without_waiting_gives_up_at_once_on_a_lock_of_another_process(tmp_path: Path) -> None:
    """A writer the gate does not know (another process; here a plain connection) holds SQLite's
    lock: a write inside `without_waiting()` does not sleep through the busy timeout, and the
    pooled connection it used waits through it again for the next writer."""
    url = sqlite_url_for(tmp_path)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE t (x INTEGER PRIMARY KEY)"))
        other = sqlite3.connect(tmp_path / "dss.sqlite3", isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")
        start = time.perf_counter()
        with pytest.raises(OperationalError) as refused, without_waiting(), engine.begin() as conn:
            conn.execute(text("INSERT INTO t VALUES (1)"))
        assert time.perf_counter() - start < 0.5 and would_wait(refused.value)
        threading.Timer(0.3, other.rollback).start()
        start = time.perf_counter()
        with engine.begin() as conn:  # the same pooled connection: it waits for the lock again
            conn.execute(text("INSERT INTO t VALUES (2)"))
        assert time.perf_counter() - start >= 0.25
        other.close()
        assert not would_wait(sqlite3.OperationalError("no such table: u"))
    finally:
        engine.dispose()


def test_a_reserved_gate_is_kept_for_its_thread_before_every_other_waiter() -> None:
    """`WriteGate.reserve` (the event loop's short writes, issue 31): kept at once when free;
    else `wake` is called when the writer inside leaves, and the gate stays kept for the
    reserving thread (a first-in-line writer waiting too comes after it) until it enters or
    gives the reservation up; a wake-up that fails, or a keep never taken up, frees it."""
    gate = WriteGate()
    assert gate.reserve(lambda: None)  # free: kept now
    gate.acquire(1.0)
    gate.release()
    gate.unreserve(lambda: None)  # used by the write: nothing left to give up
    assert gate.free()

    order: list[str] = []
    woken = threading.Event()
    inside = threading.Event()

    def first_writer() -> None:
        inside.wait(5)
        with first_in_line():
            gate.acquire(5.0)
        order.append("first-in-line")
        gate.release()

    def reserver() -> None:
        assert not gate.reserve(woken.set)  # someone is inside: queued
        assert woken.wait(5)
        time.sleep(0.1)  # kept meanwhile: the first-in-line writer waits
        gate.acquire(0.01)
        order.append("reserved")
        gate.release()
        gate.unreserve(woken.set)

    gate.acquire(1.0)  # this thread is inside
    threads = [threading.Thread(target=first_writer), threading.Thread(target=reserver)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    inside.set()
    time.sleep(0.1)
    gate.release()
    for t in threads:
        t.join(5)
    assert order == ["reserved", "first-in-line"] and gate.free()

    def failing_wake() -> None:
        raise RuntimeError("Event loop is closed")

    gate.acquire(1.0)
    reserved = threading.Thread(target=lambda: gate.reserve(failing_wake))
    reserved.start()
    reserved.join(5)
    gate.release()
    assert gate.free()  # the reservation whose wake-up failed was dropped

    held = threading.Thread(target=lambda: gate.reserve(lambda: None))
    held.start()
    held.join(5)  # kept for a thread that never enters (it is gone)
    assert not gate.free()
    start = time.perf_counter()
    gate.acquire(5.0)
    assert RESERVATION_TTL_S - 0.1 <= time.perf_counter() - start < RESERVATION_TTL_S + 1.0
    gate.release()


def test_one_threads_reservations_are_kept_one_at_a_time() -> None:
    """An event loop's thread holds a reservation per waiting write: giving one up never drops
    the keep that another of them was handed."""
    gate = WriteGate()
    inside, leave = threading.Event(), threading.Event()

    def writer() -> None:
        gate.acquire(1.0)
        inside.set()
        leave.wait(5)
        gate.release()

    t = threading.Thread(target=writer)
    t.start()
    assert inside.wait(5)
    woken: list[str] = []
    first, second = (lambda: woken.append("first")), (lambda: woken.append("second"))
    assert not gate.reserve(first) and not gate.reserve(second)
    leave.set()
    t.join(5)
    assert woken == ["first"]  # kept for the first
    gate.unreserve(second)  # the second gives up: the first's keep stands

    def free_for_another_thread() -> bool:
        answer: list[bool] = []
        other = threading.Thread(target=lambda: answer.append(gate.free()))
        other.start()
        other.join(5)
        return answer[0]

    assert not free_for_another_thread()
    gate.acquire(0.01)  # the first's write takes it up
    gate.release()
    gate.unreserve(first)
    assert free_for_another_thread() and woken == ["first"]


def test_a_keep_handed_to_one_reservation_is_not_taken_by_a_new_one_of_the_same_thread() -> None:
    """The loop was woken for one write and has not run it yet when another write of the loop
    asks: the new one queues behind it instead of taking over its keep."""
    gate = WriteGate()
    woken: list[str] = []
    first, second = (lambda: woken.append("first")), (lambda: woken.append("second"))
    held = threading.Thread(target=lambda: gate.acquire(1.0))
    held.start()
    held.join(5)
    assert not gate.reserve(first)
    gate.release()  # from another thread than the holder's, as a closed connection may
    assert woken == ["first"]
    assert not gate.reserve(second)  # kept for the first: the second waits its turn
    gate.acquire(0.01)  # the first's write
    gate.release()
    assert woken == ["first", "second"]
    gate.unreserve(first)
    gate.acquire(0.01)  # the second's write
    gate.release()
    gate.unreserve(second)
    assert gate.free()
