"""A small local RPC between the store's owner process and vLLM's engine processes.

Only control messages cross the socket (token ids, page hashes, slot numbers); page bytes move
through the host tier's shared-memory arena. The transport is `multiprocessing.connection` framing
over a unix socket with its HMAC challenge (`authkey`), one thread per connected client.

Every cross-process call has a deadline. A call that does not answer in time raises
`StoreTimeout`; one that cannot reach the owner raises `StoreUnavailable` (its base class). The
engine treats both as a cache miss and recomputes; neither ever hangs it. The client counts them,
logs them (rate-limited) and reconnects on the next call, so an owner restarted at the same
address with the same authkey (`dss.derive.rpc_authkey` of the same server secret) is picked up again.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from dss.errors import DSSError, InvalidInput
from dss.namespace import ModelFingerprint
from dss.types import FingerprintId, TenantId
from dss.wire import LoadPlan, PageSlot, SavePlan

log = logging.getLogger("dss.rpc")

__all__ = [
    "LoadPlan",
    "PageSlot",
    "SavePlan",
    "StoreClient",
    "StoreServer",
    "StoreService",
    "StoreTimeout",
    "StoreUnavailable",
    "socket_path_for",
]

_MAX_UNIX_PATH = 107  # sun_path is 108 bytes on Linux, NUL included


class StoreUnavailable(DSSError):
    """The store's owner process cannot be reached; callers treat it as a cache miss."""


class StoreTimeout(StoreUnavailable):
    """The owner did not answer within the call's deadline; callers treat it as a cache miss."""


class _Timeout(Exception):
    """Internal: a connect, handshake, send or reply missed the call's deadline."""


def socket_path_for(run_dir: Path) -> str:
    """Where a store in `run_dir` listens: `run_dir/store.sock`, or, when that path is over the
    unix-socket limit (a deep data directory), a private folder of ours in the temp directory
    named by the run dir's hash, so the address stays stable across restarts. That folder is
    created 0700 and refused if it exists and is not ours or not private (planted by another
    local user)."""
    preferred = run_dir / "store.sock"
    if len(os.fsencode(str(preferred))) <= _MAX_UNIX_PATH:
        return str(preferred)
    digest = hashlib.blake2b(os.fsencode(str(run_dir.resolve())), digest_size=12).hexdigest()
    folder = Path(tempfile.gettempdir()) / f"dss-rpc-{os.getuid()}-{digest}"
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise StoreUnavailable(
                f"{folder} exists but is not a private folder of this user: remove it, or use a "
                "shorter data directory"
            ) from None
    return str(folder / "store.sock")


class StoreService(Protocol):
    """What `StoreServer` calls: the store facade (`dss.store.Store` implements it)."""

    def register_fingerprint(self, fp: ModelFingerprint) -> str: ...

    def begin_load(
        self,
        fid: FingerprintId,
        tenant: TenantId,
        tokens: np.ndarray,
        start_token: int,
        max_tokens: int,
    ) -> LoadPlan | None: ...

    def wait_loaded(
        self, load_id: str, timeout_s: float, *, release: bool = False, shard: int | None = None
    ) -> tuple[PageSlot | None, ...]: ...

    def release(self, load_id: str, shard: int | None = None) -> None: ...

    def plan_save(
        self, fid: FingerprintId, tenant: TenantId, tokens: np.ndarray, n_pages: int, with_tail: bool = False
    ) -> SavePlan: ...

    def commit_save(self, save_id: str, written: Sequence[int], shard: int = 0) -> int: ...

    def abort_save(self, save_id: str, shard: int | None = None) -> None: ...

    def stats(self) -> Mapping[str, Any]: ...


def _shard(value: object) -> int | None:
    """An engine rank's index as sent over the wire: None, or a non-negative int."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"shard must be a non-negative integer, not {value!r}")
    return value


def _set_io_timeouts(sock: socket.socket, seconds: float) -> None:
    """Bound every blocking recv and send syscall on `sock` (kernel SO_RCVTIMEO/SO_SNDTIMEO);
    0 means no bound. An expired bound raises `BlockingIOError` (EAGAIN) in the caller."""
    # at least 1 ms: a real bound must never round down to 0, which means "none"
    usec_total = max(1000, int(seconds * 1_000_000)) if seconds > 0 else 0
    tv = struct.pack("@ll", usec_total // 1_000_000, usec_total % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _set_conn_timeouts(conn: Connection, seconds: float) -> None:
    """`_set_io_timeouts` on the socket a `Connection` owns (borrowed, not closed)."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setblocking(True)
        _set_io_timeouts(sock, seconds)
    finally:
        sock.detach()


def _check_address(address: str) -> None:
    n = len(os.fsencode(address))
    if n > _MAX_UNIX_PATH:
        raise ValueError(f"unix socket path too long ({n} > {_MAX_UNIX_PATH} bytes): {address}")


# ====================================================================== server
class StoreServer:
    """Serves a `StoreService` on a unix socket at `address` (mode 0600) to clients holding
    `authkey`.

    The accept thread only accepts; each connection gets a thread that runs the authkey
    challenge under `handshake_timeout_s` and then serves that client's calls in order, so a
    client that connects and stays silent ties up only its own thread. A stale socket file at
    `address` is replaced. If the socket's directory is missing it is created with mode 0700; an
    existing directory is left as it is (a warning is logged if it is world-accessible).

    After the handshake a connection waits for requests without a bound (idle engines are
    normal), while each send of a reply stays bounded by `handshake_timeout_s`, so a client that
    stops reading loses its connection instead of pinning its thread forever."""

    def __init__(
        self, service: StoreService, address: str, authkey: bytes, *, handshake_timeout_s: float = 5.0
    ) -> None:
        _check_address(address)
        self.service = service
        self.address = address
        self.authkey = authkey
        self.handshake_timeout_s = handshake_timeout_s
        self._closed = False
        self._conns: set[Connection] = set()
        self._conns_lock = threading.Lock()
        self._methods: dict[str, Callable[..., Any]] = {
            "ping": lambda: "pong",
            "register_fingerprint": self._register_fingerprint,
            "lookup": self._lookup,
            "wait_loaded": self._wait_loaded,
            "release": self._release,
            "plan_save": self._plan_save,
            "commit_save": self._commit_save,
            "abort_save": self._abort_save,
            "stats": service.stats,
        }
        self._sock = self._listen(address)
        self._thread = threading.Thread(target=self._accept_loop, name="dss-rpc-accept", daemon=True)
        self._thread.start()

    @staticmethod
    def _listen(address: str) -> socket.socket:
        directory = Path(address).parent
        if not directory.exists():
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        elif directory.stat().st_mode & stat.S_IRWXO:
            log.warning("RPC socket directory %s is world-accessible; the socket itself is 0600", directory)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.fchmod(sock.fileno(), 0o600)  # Linux: the socket file is created 0600, no window
            sock.bind(address)
            os.chmod(address, 0o600)
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        return sock

    # --- method table ---------------------------------------------------------------------
    def _register_fingerprint(self, fp_json: str) -> str:
        return str(self.service.register_fingerprint(ModelFingerprint.from_json(fp_json)))

    def _lookup(
        self, fid: str, tenant: str, tokens: np.ndarray, start_token: int, max_tokens: int
    ) -> LoadPlan | None:
        return self.service.begin_load(FingerprintId(fid), TenantId(tenant), tokens, start_token, max_tokens)

    def _wait_loaded(
        self, load_id: str, timeout_s: float, release: bool, shard: int | None = None
    ) -> tuple[PageSlot | None, ...]:
        return tuple(self.service.wait_loaded(load_id, timeout_s, release=release, shard=_shard(shard)))

    def _plan_save(
        self, fid: str, tenant: str, tokens: np.ndarray, n_pages: int, with_tail: bool = False
    ) -> SavePlan:
        return self.service.plan_save(FingerprintId(fid), TenantId(tenant), tokens, n_pages, bool(with_tail))

    def _commit_save(self, save_id: str, written: list[int], shard: int = 0) -> int:
        return int(self.service.commit_save(save_id, written, _shard(shard) or 0))

    def _release(self, load_id: str, shard: int | None = None) -> None:
        self.service.release(load_id, _shard(shard))

    def _abort_save(self, save_id: str, shard: int | None = None) -> None:
        self.service.abort_save(save_id, _shard(shard))

    # --- connections ----------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                log.warning("RPC accept failed", exc_info=True)
                time.sleep(0.05)  # e.g. EMFILE: do not spin
                continue
            try:
                sock.setblocking(True)
                _set_io_timeouts(sock, self.handshake_timeout_s)
                conn = Connection(sock.detach())
            except OSError:
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="dss-rpc-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with self._conns_lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        try:
            with conn:
                if self._handshake(conn):
                    self._serve_loop(conn)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)

    def _handshake(self, conn: Connection) -> bool:
        """The server side of the authkey challenge, bounded by the socket's handshake timeout.
        Afterwards a request may take as long as the client likes to arrive; sends keep the bound."""
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
            sock = socket.socket(fileno=conn.fileno())
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 0, 0))
            finally:
                sock.detach()
        except (AuthenticationError, AssertionError, OSError, EOFError) as exc:
            if not self._closed:
                log.warning("rejected an RPC connection on %s: %s", self.address, exc or type(exc).__name__)
            return False
        return True

    def _serve_loop(self, conn: Connection) -> None:
        while not self._closed:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                return
            except Exception:  # an undecodable request: the stream is no longer trustworthy
                log.warning("undecodable RPC request on %s", self.address, exc_info=True)
                return
            reply = self._dispatch(request)
            try:
                conn.send(reply)
            except (OSError, EOFError):
                return
            except Exception as exc:  # the result does not pickle (nothing was written yet)
                log.exception("RPC reply could not be encoded")
                try:
                    conn.send((False, (type(exc).__name__, str(exc))))
                except Exception:
                    return

    def _dispatch(self, request: object) -> tuple[bool, Any]:
        method = "?"
        try:
            if not (isinstance(request, tuple) and len(request) == 2 and isinstance(request[1], tuple)):
                raise DSSError("malformed RPC request")
            method, args = request
            fn = self._methods.get(method)
            if fn is None:
                raise DSSError(f"unknown RPC method {method!r}")
            return True, fn(*args)
        except DSSError as exc:
            return False, (type(exc).__name__, str(exc))
        except Exception as exc:
            log.exception("RPC %s failed", method)
            return False, (type(exc).__name__, str(exc))

    def close(self) -> None:
        """Stop accepting and hang up every client, so that engines reconnect (and find the
        store that replaces this one) instead of talking to a closed store."""
        with self._conns_lock:
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (Linux)
        with contextlib.suppress(OSError):
            self._sock.close()
        for conn in conns:
            # shutdown (not just close) wakes the serving thread blocked in recv on this socket
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address)
        self._thread.join(timeout=1.0)


# ====================================================================== client
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

    Calls are serialised on one connection and the lock is held while the reply is awaited: a
    blocking `wait_loaded` holds the client until it returns, so a thread that waits for loads
    should use a client of its own.

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
        self._lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._backoff_until = 0.0
        self._last_warn = -float("inf")
        self._suppressed = 0

    # --- transport ------------------------------------------------------------------------
    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        budget = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        self._fail_fast_if_backing_off(method)
        if not self._lock.acquire(timeout=max(0.0, budget)):
            self._failed(method, timed_out=True, backoff=False, why="client busy with another call")
        try:
            self._fail_fast_if_backing_off(method)
            ok, value = self._exchange(method, args, deadline)
        finally:
            self._lock.release()
        if not ok:
            name, message = value
            raise DSSError(f"{name}: {message}")
        return value

    def _exchange(self, method: str, args: tuple[Any, ...], deadline: float) -> tuple[bool, Any]:
        """One request and its reply, under the lock; retried once on a fresh connection."""
        for attempt in range(2):
            try:
                conn = self._conn if self._conn is not None else self._connect(deadline)
                self._conn = conn
                _set_conn_timeouts(conn, self._remaining(deadline))
                conn.send((method, args))
                if not conn.poll(self._remaining(deadline)):
                    raise _Timeout
                reply = conn.recv()
            except (_Timeout, BlockingIOError, TimeoutError):
                self._drop()
                self._failed(method, timed_out=True, backoff=True, why="no answer within the deadline")
            except (AuthenticationError, AssertionError) as exc:  # wrong authkey: retrying cannot help
                self._drop()
                self._failed(method, timed_out=False, backoff=False, why=f"handshake failed: {exc}")
            except (OSError, EOFError) as exc:
                self._drop()
                if attempt == 1:
                    self._failed(method, timed_out=False, backoff=False, why=f"{type(exc).__name__}: {exc}")
                continue
            if not (isinstance(reply, tuple) and len(reply) == 2):
                self._drop()
                self._failed(method, timed_out=False, backoff=False, why="malformed reply")
            return reply
        raise AssertionError("unreachable")

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
            _set_io_timeouts(sock, min(self.connect_timeout_s, self._remaining(deadline)))
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
            raise _Timeout
        return left

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None

    def _fail_fast_if_backing_off(self, method: str) -> None:
        if time.monotonic() < self._backoff_until:
            with self._count_lock:
                self.failures += 1
            raise StoreUnavailable(f"store at {self.address} timed out recently; {method} not attempted")

    def _failed(self, method: str, *, timed_out: bool, backoff: bool, why: str) -> None:
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

    def lookup(
        self,
        fingerprint: FingerprintId,
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
            "lookup", str(fingerprint), str(tenant), arr, start_token, max_tokens, timeout_s=timeout_s
        )
        return plan

    def wait_loaded(
        self, load_id: str, timeout_s: float, release: bool = False, *, shard: int | None = None
    ) -> tuple[PageSlot | None, ...]:
        """Wait up to `timeout_s` (on the owner) for a plan's pages; `release` also releases the
        lease (this engine rank's part, `shard`) in the same round trip. The call's deadline is
        `timeout_s + wait_grace_s`."""
        pages = self._call(
            "wait_loaded", load_id, timeout_s, release, shard, timeout_s=timeout_s + self.wait_grace_s
        )
        return tuple(pages)

    def release(self, load_id: str, *, shard: int | None = None, timeout_s: float | None = None) -> None:
        self._call("release", load_id, shard, timeout_s=timeout_s)

    def plan_save(
        self,
        fingerprint: FingerprintId,
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
            "plan_save", str(fingerprint), str(tenant), arr, n_pages, with_tail, timeout_s=timeout_s
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

    def close(self) -> None:
        """Drop the connection (after any call in flight, which its deadline bounds). A later
        call connects again."""
        with self._lock:
            self._drop()
