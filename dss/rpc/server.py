"""The owner's side of the local RPC: `StoreServer` accepts engine processes on a unix socket and
answers their calls from an `EngineStore` (`dss.rpc.contract`), decoding each call's wire arguments
in its method table.

Lock: `StoreServer._conns_lock` is a leaf around the set of open connections and the closed flag;
sockets are closed and shut down after it is released.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

import numpy as np

from dss.errors import DSSError, InvalidInput
from dss.namespace import ModelFingerprint
from dss.rpc.contract import ENGINE_CALLS, EngineStore
from dss.rpc.transport import check_address, set_io_timeouts
from dss.types import FingerprintId, TenantId
from dss.wire import LoadPlan, PageEventBatch, PageSlot, SavePlan

log = logging.getLogger("dss.rpc")


def _shard(value: object) -> int | None:
    """An engine rank's index as sent over the wire: None, or a non-negative int."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"shard must be a non-negative integer, not {value!r}")
    return value


class StoreServer:
    """Serves an `EngineStore` on a unix socket at `address` (mode 0600) to clients holding
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
        self, service: EngineStore, address: str, authkey: bytes, *, handshake_timeout_s: float = 5.0
    ) -> None:
        check_address(address)
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
            "begin_load": self._begin_load,
            "wait_loaded": self._wait_loaded,
            "release": self._release,
            "release_checked": self._release_checked,
            "plan_save": self._plan_save,
            "commit_save": self._commit_save,
            "abort_save": self._abort_save,
            "stats": service.stats,
            "take_events": self._take_events,
        }
        assert set(self._methods) == {"ping", *ENGINE_CALLS}, "the method table follows the contract"
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

    def _begin_load(
        self, fid: str, tenant: str, tokens: np.ndarray, start_token: int, max_tokens: int
    ) -> LoadPlan | None:
        return self.service.begin_load(FingerprintId(fid), TenantId(tenant), tokens, start_token, max_tokens)

    def _wait_loaded(self, load_id: str, timeout_s: float) -> tuple[PageSlot | None, ...]:
        return tuple(self.service.wait_loaded(load_id, timeout_s))

    def _plan_save(
        self, fid: str, tenant: str, tokens: np.ndarray, n_pages: int, with_tail: bool = False
    ) -> SavePlan:
        return self.service.plan_save(
            FingerprintId(fid), TenantId(tenant), tokens, n_pages, with_tail=bool(with_tail)
        )

    def _commit_save(self, save_id: str, written: list[int], shard: int = 0) -> int:
        return int(self.service.commit_save(save_id, written, shard=_shard(shard) or 0))

    def _release(self, load_id: str, shard: int | None = None) -> None:
        self.service.release(load_id, shard=_shard(shard))

    def _release_checked(self, load_id: str, shard: int | None = None) -> int:
        return int(self.service.release_checked(load_id, shard=_shard(shard)))

    def _abort_save(self, save_id: str, shard: int | None = None) -> None:
        self.service.abort_save(save_id, shard=_shard(shard))

    def _take_events(self, fid: str, epoch: str, after: int, limit: int) -> PageEventBatch:
        return self.service.take_events(FingerprintId(fid), str(epoch), int(after), max(1, int(limit)))

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
                set_io_timeouts(sock, self.handshake_timeout_s)
                conn = Connection(sock.detach())
            except OSError:
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="dss-rpc-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with self._conns_lock:
            refused = self._closed
            if not refused:
                self._conns.add(conn)
        if refused:  # closed after the lock: socket work never runs under it
            conn.close()
            return
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
