"""The engine processes' side of the local RPC: `StoreClient`, the contract (`EngineStore`) over
the socket, with a deadline on every call.

A call that does not answer in time raises `StoreTimeout`; one that cannot reach the owner raises
`StoreUnavailable` (its base class). The engine treats both as a cache miss and recomputes;
neither ever hangs it. The client counts them, logs them (rate-limited) and reconnects on the next
call, so an owner restarted at the same address with the same authkey is picked up again.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from dss.errors import DSSError
from dss.namespace import ModelFingerprint
from dss.rpc.contract import EngineStore
from dss.rpc.transport import (
    DeadlineMissed,
    StoreTimeout,
    StoreUnavailable,
    set_conn_timeouts,
    set_io_timeouts,
)
from dss.types import FingerprintId
from dss.wire import LoadPlan, PageEventBatch, PageSlot, SavePlan

log = logging.getLogger("dss.rpc")


@dataclass(frozen=True, slots=True)
class _Failure:
    """A call that failed under the connection's lock, raised by `_call` after releasing it."""

    timed_out: bool = False
    backoff: bool = False
    why: str = ""


_BACKING_OFF = _Failure(why="backing off")  # the call was not attempted


@dataclass(slots=True)
class _Exchange:
    """One request sent, its reply still to read; the client's connection is held until then."""

    method: str
    args: tuple[Any, ...]
    deadline: float  # the send's and the reply's
    sent: _Failure | None  # a failure to send (None: sent)


class StoreClient:
    """Thread-safe client used in vLLM's scheduler and worker processes. Every failure raises
    `StoreUnavailable` (or `StoreTimeout`, a subclass) or another `DSSError` sent back by the
    owner as `DSSError("<ExceptionName>: <message>")`; callers treat all of them as a miss.

    Deadlines: each call has one, `timeout_s` (per-call override on every method), covering the
    wait for this client's lock, the (re)connect and handshake (each also bounded by
    `connect_timeout_s`), the request and the reply. `wait_loaded` uses its own wait plus
    `wait_grace_s`. A call that misses its deadline drops the connection (a late reply would
    desynchronise it) and raises `StoreTimeout`; for the next `backoff_s` seconds calls fail fast
    with `StoreUnavailable` without touching the socket, so a hung owner is not hammered.

    Reconnects: a broken connection (owner exited or restarted) is dropped and the call retried
    once on a fresh one; if that fails too the call raises `StoreUnavailable`. The next call
    connects again, so an owner restarted at the same address with the same authkey is reached.

    Calls are serialised on one connection: `_lock` is the connection's turn, held for one
    request and its reply (a blocking `wait_loaded` holds the client until it returns, so a thread
    that waits for loads should use a client of its own). It is the one lock in `dss` held across
    I/O, on purpose: a connection carries one exchange at a time, and the socket I/O under it is
    bounded by the call's deadline. Nothing under it takes another lock or calls back; the
    failure is counted and logged (under `_count_lock`, a leaf) after it is released.

    `failures` counts calls that raised `StoreUnavailable` (timeouts included) and `timeouts`
    those that missed their deadline; the connector reads both for its per-request reports."""

    WARN_INTERVAL_S = 10.0

    def __init__(
        self,
        address: str,
        authkey: bytes,
        *,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        backoff_s: float = 1.0,
        wait_grace_s: float = 2.0,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.backoff_s = backoff_s
        self.wait_grace_s = wait_grace_s
        self.failures = 0
        self.timeouts = 0
        self._authkey = authkey
        self._conn: Connection | None = None
        self._io_bound: float | None = None  # the kernel bound set on `_conn` (`_bound_io`)
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._backoff_until = 0.0
        self._last_warn = -float("inf")
        self._suppressed = 0

    # --- transport ------------------------------------------------------------------------
    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        return self._finish(self._start(method, args, timeout_s))

    def _start(self, method: str, args: tuple[Any, ...], timeout_s: float | None) -> _Exchange:
        """Send one request and hold the connection for its reply (`_finish`)."""
        budget = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        self._fail_fast_if_backing_off(method)
        if not self._lock.acquire(timeout=max(0.0, budget)):
            self._failed(method, timed_out=True, backoff=False, why="client busy with another call")
        try:
            backing_off = time.monotonic() < self._backoff_until
            sent = _BACKING_OFF if backing_off else self._send(method, args, deadline)
        except BaseException:
            self._lock.release()
            raise
        return _Exchange(method, args, deadline, sent)

    def _finish(self, call: _Exchange) -> Any:
        """Read `call`'s reply by its deadline (or take its failure), let go of the connection,
        then raise any failure."""
        try:
            outcome = call.sent if call.sent is not None else self._receive(call)
        finally:
            self._lock.release()
        if outcome is _BACKING_OFF:
            self._fail_fast(call.method)
        if isinstance(outcome, _Failure):
            self._failed(call.method, timed_out=outcome.timed_out, backoff=outcome.backoff, why=outcome.why)
        ok, value = outcome
        if not ok:
            name, message = value
            raise DSSError(f"{name}: {message}")
        return value

    def _send(self, method: str, args: tuple[Any, ...], deadline: float) -> _Failure | None:
        """Send one request, under the lock, connecting first when needed; a broken connection
        is replaced once. A failure is returned, for `_finish` to count and raise."""
        for attempt in range(2):
            try:
                conn = self._conn if self._conn is not None else self._connect(deadline)
                self._conn = conn
                self._bound_io(conn, deadline)
                conn.send((method, args))
                return None
            except Exception as exc:
                failure = self._broken(exc, last=attempt == 1)
                if failure is not None:
                    return failure
        raise AssertionError("unreachable")

    def _receive(self, call: _Exchange) -> tuple[bool, Any] | _Failure:
        """The reply to the request just sent, under the lock; a connection that broke before
        it answered is replaced and the request sent again, once."""
        for attempt in range(2):
            try:
                conn = self._conn
                if conn is None:
                    raise EOFError("connection dropped")
                if not conn.poll(self._remaining(call.deadline)):
                    raise DeadlineMissed
                reply = conn.recv()
            except Exception as exc:
                failure = self._broken(exc, last=attempt == 1)
                if failure is None:  # sent again on a fresh connection, within the same deadline
                    failure = self._send(call.method, call.args, call.deadline)
                if failure is not None:
                    return failure
                continue
            if not (isinstance(reply, tuple) and len(reply) == 2):
                self._drop()
                return _Failure(why="malformed reply")
            return reply
        raise AssertionError("unreachable")

    def _bound_io(self, conn: Connection, deadline: float) -> None:
        """Bound `conn`'s blocking send and recv syscalls within `deadline`. Setting the kernel
        bounds takes six syscalls, each a chance for another thread to take the GIL (40 us a call
        inside a busy engine process, two calls on every hot turn's path: issue 31), so a bound is
        set to 90 % of the time left and kept while it stays between 80 % and 100 % of it: no
        syscall of a call outlasts its deadline, and one may give up at most a fifth early."""
        left = self._remaining(deadline)
        if self._io_bound is not None and 0.8 * left <= self._io_bound <= left:
            return
        bound = 0.9 * left
        set_conn_timeouts(conn, bound)
        self._io_bound = bound

    def _broken(self, exc: Exception, *, last: bool) -> _Failure | None:
        """What a failed send or receive means: the connection is dropped (a late reply would
        desynchronise it), and a failure returned, or None where a fresh connection may help."""
        if isinstance(exc, (DeadlineMissed, BlockingIOError, TimeoutError)):
            self._drop()
            return _Failure(timed_out=True, backoff=True, why="no answer within the deadline")
        if isinstance(exc, (AuthenticationError, AssertionError)):  # wrong authkey: retrying cannot help
            self._drop()
            return _Failure(why=f"handshake failed: {exc}")
        if isinstance(exc, (OSError, EOFError)):
            self._drop()
            return _Failure(why=f"{type(exc).__name__}: {exc}") if last else None
        raise exc

    def _connect(self, deadline: float) -> Connection:
        """A fresh, authenticated connection. `connect` runs under a socket timeout and the
        handshake under kernel recv/send timeouts, both at most `connect_timeout_s` and within
        the call's deadline; the same challenge order as `multiprocessing.connection.Client`."""
        bound = min(self.connect_timeout_s, self._remaining(deadline))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(bound)
            sock.connect(self.address)
            sock.setblocking(True)
            set_io_timeouts(sock, min(self.connect_timeout_s, self._remaining(deadline)))
            conn = Connection(sock.detach())
        except BaseException:
            sock.close()
            raise
        try:
            answer_challenge(conn, self._authkey)
            deliver_challenge(conn, self._authkey)
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    def _remaining(deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineMissed
        return left

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
        self._io_bound = None

    def _fail_fast_if_backing_off(self, method: str) -> None:
        if time.monotonic() < self._backoff_until:
            self._fail_fast(method)

    def _fail_fast(self, method: str) -> NoReturn:
        with self._count_lock:
            self.failures += 1
        raise StoreUnavailable(f"store at {self.address} timed out recently; {method} not attempted")

    def _failed(self, method: str, *, timed_out: bool, backoff: bool, why: str) -> NoReturn:
        """Count, log (rate-limited) and raise the failure of one call."""
        now = time.monotonic()
        with self._count_lock:
            self.failures += 1
            if timed_out:
                self.timeouts += 1
            if backoff:
                self._backoff_until = now + self.backoff_s
            if now - self._last_warn >= self.WARN_INTERVAL_S:
                self._last_warn, suppressed, self._suppressed = now, self._suppressed, 0
                log.warning(
                    "store RPC %s at %s failed: %s (%d similar failures not logged)",
                    method,
                    self.address,
                    why,
                    suppressed,
                )
            else:
                self._suppressed += 1
        message = f"store at {self.address}: {method}: {why}"
        if timed_out:
            raise StoreTimeout(message)
        raise StoreUnavailable(message)

    # --- methods --------------------------------------------------------------------------
    def ping(self, *, timeout_s: float | None = None) -> bool:
        return bool(self._call("ping", timeout_s=timeout_s) == "pong")

    def register_fingerprint(self, fp: ModelFingerprint, *, timeout_s: float | None = None) -> FingerprintId:
        return FingerprintId(self._call("register_fingerprint", fp.to_json(), timeout_s=timeout_s))

    def begin_load(
        self,
        fid: FingerprintId,
        tenant: str,
        tokens: Sequence[int] | np.ndarray,
        start_token: int,
        max_tokens: int,
        *,
        timeout_s: float | None = None,
    ) -> LoadPlan | None:
        """Match and pin the stored pages of `tokens` after `start_token` (`begin_load`)."""
        arr = np.asarray(tokens, dtype="<i4")
        plan: LoadPlan | None = self._call(
            "begin_load", str(fid), str(tenant), arr, start_token, max_tokens, timeout_s=timeout_s
        )
        return plan

    def wait_loaded(self, load_id: str, timeout_s: float) -> tuple[PageSlot | None, ...]:
        """Wait up to `timeout_s` (on the owner) for a plan's pages (`release_checked` ends the
        lease after the copy). The call's deadline is `timeout_s + wait_grace_s`."""
        pages = self._call("wait_loaded", load_id, timeout_s, timeout_s=timeout_s + self.wait_grace_s)
        return tuple(pages)

    def release_checked(
        self, load_id: str, *, shard: int | None = None, timeout_s: float | None = None
    ) -> int:
        """End this engine rank's (`shard`) part of a lease after copying: how many pages, from
        the first, its copies can be trusted for."""
        return int(self._call("release_checked", load_id, shard, timeout_s=timeout_s))

    def release(self, load_id: str, *, shard: int | None = None, timeout_s: float | None = None) -> None:
        """End this engine rank's (`shard`) part of a lease without waiting for its pages."""
        self._call("release", load_id, shard, timeout_s=timeout_s)

    def plan_save(
        self,
        fid: FingerprintId,
        tenant: str,
        tokens: Sequence[int] | np.ndarray,
        n_pages: int,
        *,
        with_tail: bool = False,
        timeout_s: float | None = None,
    ) -> SavePlan:
        """Reserve slots for the pages of `tokens` the store lacks (`KVCache.plan_save`)."""
        arr = np.asarray(tokens, dtype="<i4")
        plan: SavePlan = self._call(
            "plan_save", str(fid), str(tenant), arr, n_pages, with_tail, timeout_s=timeout_s
        )
        return plan

    def commit_save(
        self, save_id: str, written: Sequence[int], *, shard: int = 0, timeout_s: float | None = None
    ) -> int:
        """This engine rank (`shard`) copied pages `written`; the store publishes them once every
        rank of the engine reported."""
        return int(self._call("commit_save", save_id, [int(i) for i in written], shard, timeout_s=timeout_s))

    def abort_save(self, save_id: str, *, shard: int | None = None, timeout_s: float | None = None) -> None:
        self._call("abort_save", save_id, shard, timeout_s=timeout_s)

    def stats(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return dict(self._call("stats", timeout_s=timeout_s))

    def take_events(
        self, fid: FingerprintId, epoch: str, after: int, limit: int = 4096, *, timeout_s: float | None = None
    ) -> PageEventBatch:
        """The page events of `fid` after id `after` of log `epoch`, or a resync (`take_events`)."""
        batch = self._call("take_events", str(fid), epoch, int(after), int(limit), timeout_s=timeout_s)
        if not isinstance(batch, PageEventBatch):
            raise DSSError(f"take_events answered {type(batch).__name__}")
        return batch

    def close(self) -> None:
        """Drop the connection (after any call in flight, which its deadline bounds). A later
        call connects again."""
        with self._lock:
            self._drop()


if TYPE_CHECKING:  # mypy checks that the client follows the contract

    def _client_follows_the_contract(client: StoreClient) -> EngineStore:
        return client
