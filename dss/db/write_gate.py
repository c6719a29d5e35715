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
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Python's sqlite3 (3.11, `isolation_level=""`) opens a transaction before these statements only.
_DML = re.compile(r"\s*(?:INSERT|UPDATE|DELETE|REPLACE)\b", re.IGNORECASE)

_first = threading.local()


@contextmanager
def first_in_line() -> Iterator[None]:
    """Writes of this thread inside the block go before other waiting writers (`WriteGate`):
    for short metadata transactions that a client waits for, such as a rollback."""
    before = getattr(_first, "on", False)
    _first.on = True
    try:
        yield
    finally:
        _first.on = before


class WriteGate:
    """The writers of one SQLite file in this process, one at a time, first-in-line ones first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._owner: int | None = None  # thread id
        self._depth = 0
        self._waiting_first = 0

    def acquire(self, timeout_s: float) -> None:
        """Enter, or `sqlite3.OperationalError("database is locked")` after `timeout_s`."""
        me = threading.get_ident()
        first = getattr(_first, "on", False)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            if first:
                self._waiting_first += 1
            try:
                while self._owner is not None or (not first and self._waiting_first):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise sqlite3.OperationalError("database is locked")
                    self._cond.wait(left)
            finally:
                if first:
                    self._waiting_first -= 1
            self._owner, self._depth = me, 1

    def release(self) -> None:
        """Leave (once per `acquire`; a connection may be closed from another thread)."""
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()


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

    def cursor(self, factory: Any = None) -> Any:
        return super().cursor(factory or GatedCursor)

    def before(self, sql: str) -> None:
        if self.gate is not None and not self._holding and not self.in_transaction and _DML.match(sql):
            self.gate.acquire(self.timeout_s)
            self._holding = True

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

    def rollback(self) -> None:
        try:
            super().rollback()
        finally:
            self.let_go()

    def close(self) -> None:
        try:
            super().close()
        finally:
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
