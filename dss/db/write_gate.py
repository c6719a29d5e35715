"""A queue in front of SQLite's one write lock, for the writers of this process (`WriteGate`).

SQLite has one write lock per database file. A connection that finds it taken does not queue:
its busy handler sleeps and tries again (1, 2, 5, 10, 15, 20, 25, 25, 25, 50, 50, 100 ms ...), so
a short write behind a writer that holds the lock 3 ms may sleep 8 ms and more, and under a steady
stream of writers (page rows, chat turns' version commits) it loses the lock to whoever happens to
ask the moment it is free, again and again (issue 31: rollback p99 94-243 ms against 20).

Every connection of a file's engines (`make_engine`: the durable and the relaxed one) passes
through the file's one gate before its transaction's first write (the statement before which
Python's `sqlite3` opens the transaction: INSERT, UPDATE, DELETE, REPLACE) and leaves it when the
transaction ends (commit, rollback, close). A waiter is woken the moment the gate is free, and
short metadata writes (`first_in_line`: a rollback, a new branch) go before the others waiting:
such a write waits for at most the one writer inside, never for a queue of them. Writers of other
processes and connections made elsewhere still meet SQLite's own lock and busy handler.

The gate is a leaf: while a connection holds it, its thread takes no other gate and waits for no
other thread (a transaction of this store never waits for another one's); what it guards is
SQLite's lock, which the holder would hold over the same statements anyway. A second connection
of the same thread that writes while the first's transaction is open passes (the gate counts per
thread) and meets SQLite's lock as before. Waiting longer than the busy timeout raises SQLite's
own `database is locked`.

A thread that must not block at all (the server's event loop, running a short write where it
is fastest) does not queue inside `acquire`: it has the gate kept for it (`reserve`: now, or
once the writer inside leaves, which calls its `wake`; before every other waiter) and writes
inside `without_waiting()`. There the gate refuses a write with `WouldWait` instead of queueing
it (when the keep was lost: another write of the same thread took it up), SQLite's busy handler
gives up at once on a lock of another process, and the commit leaves the WAL's checkpoint to the
next writer. The caller then runs the whole transaction again where waiting is fine
(`would_wait` tells such a failure from others). A `wake` runs on the leaving thread after the
gate's lock is let go (it must not block: a `call_soon_threadsafe`).
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

# Python's sqlite3 (3.11, `isolation_level=""`) opens a transaction before these statements only.
_DML = re.compile(r"\s*(?:INSERT|UPDATE|DELETE|REPLACE)\b", re.IGNORECASE)
# SQLite's default, which `dss.db.connect` keeps: a commit that leaves the WAL at this many pages
# or more copies it back into the database file (a checkpoint: writes and an fsync).
WAL_AUTOCHECKPOINT_PAGES = 1000
# How long the gate stays kept for a reservation's thread that has not entered (`WriteGate`).
RESERVATION_TTL_S = 1.0

_first = threading.local()  # .on: `first_in_line`; .no_wait: `without_waiting`


class WouldWait(sqlite3.OperationalError):
    """Inside `without_waiting()`: the statement would have waited for another writer of this
    process. Its transaction is rolled back; nothing of it was written."""


def would_wait(exc: BaseException) -> bool:
    """Whether `exc`, raised inside `without_waiting()` (as it is or wrapped by SQLAlchemy in
    `.orig`), only says that a statement would have waited: for this process's gate, or for
    SQLite's write lock held by another process (`SQLITE_BUSY` with no busy timeout)."""
    orig = getattr(exc, "orig", exc)
    if isinstance(orig, WouldWait):
        return True
    busy = getattr(orig, "sqlite_errorcode", None) == sqlite3.SQLITE_BUSY
    return isinstance(orig, sqlite3.OperationalError) and busy


@contextmanager
def _flagged(flag: str) -> Iterator[None]:
    """Set this thread's `flag` on `_first` inside the block (nested blocks restore it)."""
    before = getattr(_first, flag, False)
    setattr(_first, flag, True)
    try:
        yield
    finally:
        setattr(_first, flag, before)


def without_waiting() -> AbstractContextManager[None]:
    """Statements of this thread inside the block never wait (see the module docstring); the
    block is synchronous (no `await` inside: another task of the loop must not inherit it)."""
    return _flagged("no_wait")


def first_in_line() -> AbstractContextManager[None]:
    """Writes of this thread inside the block go before other waiting writers (`WriteGate`):
    for short metadata transactions that a client waits for, such as a rollback."""
    return _flagged("on")


class WriteGate:
    """The writers of one SQLite file in this process, one at a time: a kept turn first
    (`reserve`), then first-in-line writers, then the others."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._owner: int | None = None  # thread id
        self._depth = 0
        self._waiting_first = 0
        # The gate is kept for this thread (`reserve`) until it enters or lets go; a keep not
        # taken up within RESERVATION_TTL_S lapses (a waiter that vanished blocks no one for good).
        self._kept_for: int | None = None
        self._kept_wake: Callable[[], None] | None = None  # whose reservation (a thread may hold several)
        self._kept_until = 0.0
        self._reservations: deque[tuple[int, Callable[[], None]]] = deque()

    def _kept(self) -> bool:
        """(Under the lock.) Whether the gate is kept for a reservation now (a lapsed keep ends)."""
        if self._kept_for is None:
            return False
        if time.monotonic() < self._kept_until:
            return True
        self._kept_for = self._kept_wake = None
        return False

    def _kept_for_other(self, me: int) -> bool:
        return self._kept() and self._kept_for != me

    def acquire(self, timeout_s: float) -> None:
        """Enter, or `sqlite3.OperationalError("database is locked")` after `timeout_s`."""
        me = threading.get_ident()
        first = getattr(_first, "on", False)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            busy = self._owner is not None or self._kept_for_other(me)
            if getattr(_first, "no_wait", False) and (busy or (self._waiting_first and self._kept_for != me)):
                raise WouldWait("another writer of this process holds or waits for the write lock")
            if first:
                self._waiting_first += 1
            try:
                while (
                    self._owner is not None
                    or self._kept_for_other(me)
                    or (not first and self._waiting_first and self._kept_for != me)
                ):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise sqlite3.OperationalError("database is locked")
                    self._cond.wait(min(left, RESERVATION_TTL_S))
            finally:
                if first:
                    self._waiting_first -= 1
            self._owner, self._depth = me, 1
            if self._kept_for == me:
                self._kept_for = self._kept_wake = None

    def reserve(self, wake: Callable[[], None]) -> bool:
        """Keep the gate for this thread's next write, before every other waiter: True when it
        is kept now; else False, and once a writer leaves and it is kept, `wake()` is called
        (on the leaving thread, after the gate's lock: it must not block). For a thread that
        must not wait inside `acquire` (an event loop: it awaits the wake-up, then writes inside
        `without_waiting()`). Call `unreserve(wake)` after the write, or when giving up."""
        me = threading.get_ident()
        with self._cond:
            # Not when kept for another reservation, of this thread too (a loop woken for one
            # write has not run it yet when another write of the loop asks).
            if self._owner is None and not self._kept() and not self._reservations:
                self._keep(me, wake)
                return True
            self._reservations.append((me, wake))
            return False

    def unreserve(self, wake: Callable[[], None]) -> None:
        """Give up this thread's reservation made with `wake`: still queued, or kept and not
        taken up by a write (one that entered has used it)."""
        me = threading.get_ident()
        with self._cond:
            self._reservations = deque(r for r in self._reservations if r[1] is not wake)
            if self._kept_for != me or self._kept_wake is not wake or self._owner == me:
                return  # used by its write, lapsed, or kept for another reservation
            self._kept_for = self._kept_wake = None
            woken = self._hand_on()
        self._wake(woken)

    def free(self) -> bool:
        """Whether a writer would enter now without waiting (no one inside, no first-in-line
        writer waiting, not kept for another thread); a moment later it may not be."""
        with self._cond:
            return (
                self._owner is None
                and not self._waiting_first
                and not self._kept_for_other(threading.get_ident())
            )

    def release(self) -> None:
        """Leave (once per `acquire`; a connection may be closed from another thread)."""
        with self._cond:
            self._depth -= 1
            if self._depth != 0:
                return
            self._owner = None
            woken = self._hand_on()
        self._wake(woken)

    def _keep(self, thread: int, wake: Callable[[], None]) -> None:
        self._kept_for, self._kept_wake = thread, wake
        self._kept_until = time.monotonic() + RESERVATION_TTL_S

    def _hand_on(self) -> tuple[int, Callable[[], None]] | None:
        """(Under the lock.) The gate is free: kept for the oldest reservation, if any."""
        self._cond.notify_all()
        if not self._reservations:
            return None
        thread, wake = self._reservations.popleft()
        self._keep(thread, wake)
        return thread, wake

    def _wake(self, woken: tuple[int, Callable[[], None]] | None) -> None:
        if woken is None:
            return
        thread, wake = woken
        try:
            wake()
        except Exception:  # its loop is closed: nobody will take the gate up
            with self._cond:
                if self._kept_for == thread and self._kept_wake is wake and self._owner is None:
                    self._kept_for = self._kept_wake = None
                    woken = self._hand_on()
                else:
                    woken = None
            self._wake(woken)


_GATES: dict[str, WriteGate] = {}
_GATES_LOCK = threading.Lock()


def gate_for(path: str) -> WriteGate:
    """The one gate of the database file at `path` (resolved) in this process."""
    with _GATES_LOCK:
        return _GATES.setdefault(path, WriteGate())


class GatedConnection(sqlite3.Connection):
    """A `sqlite3` connection whose write transactions pass its file's `WriteGate`
    (`make_engine` passes it as the connection factory and sets `gate` when it connects)."""

    gate: WriteGate | None = None
    timeout_s: float = 5.0
    _holding = False
    _not_waiting = False  # busy timeout 0 and no checkpoint at commit: `without_waiting`

    def cursor(self, factory: Any = None) -> Any:
        return super().cursor(factory or GatedCursor)

    def before(self, sql: str) -> None:
        if not self._not_waiting and getattr(_first, "no_wait", False):
            self._not_waiting = True  # first: the PRAGMAs below pass through here too
            self.execute("PRAGMA busy_timeout=0")
            self.execute("PRAGMA wal_autocheckpoint=0")
        if self.gate is not None and not self._holding and not self.in_transaction and _DML.match(sql):
            self.gate.acquire(self.timeout_s)
            self._holding = True

    def _wait_again(self) -> None:
        """The transaction of a `without_waiting` block ended: this pooled connection's next
        user waits and checkpoints as usual."""
        if self._not_waiting:
            self._not_waiting = False
            self.execute(f"PRAGMA busy_timeout={int(self.timeout_s * 1000)}")
            self.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")

    def after_failure(self) -> None:
        """A statement failed: if no transaction was opened (the BEGIN itself failed), let go."""
        if self._holding and not self.in_transaction:
            self.let_go()

    def let_go(self) -> None:
        if self._holding:
            self._holding = False
            if self.gate is not None:
                self.gate.release()

    def commit(self) -> None:
        try:
            super().commit()
        finally:
            if not self.in_transaction:
                self.let_go()
                self._wait_again()

    def rollback(self) -> None:
        try:
            super().rollback()
        finally:
            self.let_go()
            self._wait_again()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._not_waiting = False
            self.let_go()


class GatedCursor(sqlite3.Cursor):
    """Passes each statement to its connection's gate first (`GatedConnection.before`)."""

    def execute(self, sql: str, parameters: Any = (), /) -> GatedCursor:
        conn = self.connection
        assert isinstance(conn, GatedConnection)
        conn.before(sql)
        try:
            super().execute(sql, parameters)
        except BaseException:
            conn.after_failure()
            raise
        return self

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> GatedCursor:
        conn = self.connection
        assert isinstance(conn, GatedConnection)
        conn.before(sql)
        try:
            super().executemany(sql, seq_of_parameters)
        except BaseException:
            conn.after_failure()
            raise
        return self
