"""A small local RPC between the store's owner process and vLLM's engine processes.

Only control messages cross the socket (token ids, page hashes, slot numbers); page bytes move
through the host tier's shared-memory arena. The transport is `multiprocessing.connection` over
a unix socket with an HMAC challenge (`authkey`), one thread per connected client.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING, Any

import numpy as np

from dss.errors import DSSError
from dss.namespace import ModelFingerprint
from dss.plans import LoadPlan, PageSlot, SavePlan
from dss.types import FingerprintId, TenantId

if TYPE_CHECKING:
    from dss.store import Store

log = logging.getLogger("dss.rpc")

__all__ = ["LoadPlan", "PageSlot", "SavePlan", "StoreClient", "StoreServer", "StoreUnavailable"]


class StoreUnavailable(DSSError):
    """The store's owner process cannot be reached; callers treat it as a cache miss."""


class StoreServer:
    def __init__(self, store: Store, address: str, authkey: bytes) -> None:
        self.store = store
        self.address = address
        self.authkey = authkey
        if os.path.exists(address):
            os.unlink(address)
        self._listener = Listener(address, family="AF_UNIX", authkey=authkey)
        os.chmod(address, 0o600)
        self._closed = False
        self._conns: set[Connection] = set()
        self._conns_lock = threading.Lock()
        self._methods: dict[str, Callable[..., Any]] = {
            "ping": lambda: "pong",
            "register_fingerprint": self._register_fingerprint,
            "lookup": self._lookup,
            "wait_loaded": store.wait_loaded,
            "release": store.release,
            "plan_save": self._plan_save,
            "commit_save": store.commit_save,
            "abort_save": store.abort_save,
            "stats": store.stats,
        }
        self._thread = threading.Thread(target=self._accept_loop, name="dss-rpc-accept", daemon=True)
        self._thread.start()

    def _register_fingerprint(self, fp_json: str) -> str:
        return self.store.register_fingerprint(ModelFingerprint.from_json(fp_json))

    def _lookup(
        self, fid: str, tenant: str, tokens: np.ndarray, start_token: int, max_tokens: int
    ) -> LoadPlan | None:
        return self.store.begin_load(FingerprintId(fid), TenantId(tenant), tokens, start_token, max_tokens)

    def _plan_save(self, fid: str, tenant: str, tokens: np.ndarray, n_pages: int) -> SavePlan:
        return self.store.plan_save(FingerprintId(fid), TenantId(tenant), tokens, n_pages)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            except Exception:  # failed authentication and the like: keep serving others
                log.warning("rejected an RPC connection", exc_info=True)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="dss-rpc-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with self._conns_lock:
            self._conns.add(conn)
        try:
            self._serve_loop(conn)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)

    def _serve_loop(self, conn: Connection) -> None:
        with conn:
            while not self._closed:
                try:
                    method, args = conn.recv()
                except (EOFError, OSError):
                    return
                fn = self._methods.get(method)
                try:
                    if fn is None:
                        raise DSSError(f"unknown RPC method {method!r}")
                    reply: tuple[bool, Any] = (True, fn(*args))
                except DSSError as exc:
                    reply = (False, (type(exc).__name__, str(exc)))
                except Exception as exc:
                    log.exception("RPC %s failed", method)
                    reply = (False, (type(exc).__name__, str(exc)))
                try:
                    conn.send(reply)
                except (OSError, EOFError):
                    return

    def close(self) -> None:
        """Stop accepting and hang up every client, so that engines reconnect (and find the
        store that replaces this one) instead of talking to a closed store."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            # shutdown (not just close) wakes the serving thread blocked in recv on this socket
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        if os.path.exists(self.address):
            os.unlink(self.address)


class StoreClient:
    """Thread-safe client used in vLLM's scheduler and worker processes. Every failure raises
    `StoreUnavailable` or another `DSSError`; callers treat both as a miss.

    Calls are serialised on one connection: a blocking `wait_loaded` holds it until it returns,
    so a thread that waits for loads should use a client of its own."""

    def __init__(self, address: str, authkey: bytes) -> None:
        self.address = address
        self._authkey = authkey
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            for attempt in range(2):
                try:
                    if self._conn is None:
                        self._conn = Client(self.address, family="AF_UNIX", authkey=self._authkey)
                    self._conn.send((method, args))
                    ok, value = self._conn.recv()
                    break
                except (OSError, EOFError) as exc:
                    self._conn = None
                    if attempt == 1:
                        raise StoreUnavailable(f"store at {self.address} unreachable: {exc}") from exc
        if not ok:
            name, message = value
            raise DSSError(f"{name}: {message}")
        return value

    def ping(self) -> bool:
        return self._call("ping") == "pong"

    def register_fingerprint(self, fp: ModelFingerprint) -> FingerprintId:
        return FingerprintId(self._call("register_fingerprint", fp.to_json()))

    def lookup(
        self,
        fingerprint: FingerprintId,
        tenant: str,
        tokens: Sequence[int] | np.ndarray,
        start_token: int,
        max_tokens: int,
    ) -> LoadPlan | None:
        arr = np.asarray(tokens, dtype="<i4")
        plan: LoadPlan | None = self._call("lookup", fingerprint, tenant, arr, start_token, max_tokens)
        return plan

    def wait_loaded(self, load_id: str, timeout_s: float) -> tuple[PageSlot | None, ...]:
        return tuple(self._call("wait_loaded", load_id, timeout_s))

    def release(self, load_id: str) -> None:
        self._call("release", load_id)

    def plan_save(
        self, fingerprint: FingerprintId, tenant: str, tokens: Sequence[int] | np.ndarray, n_pages: int
    ) -> SavePlan:
        plan: SavePlan = self._call(
            "plan_save", fingerprint, tenant, np.asarray(tokens, dtype="<i4"), n_pages
        )
        return plan

    def commit_save(self, save_id: str, written: Sequence[int]) -> int:
        return int(self._call("commit_save", save_id, list(written)))

    def abort_save(self, save_id: str) -> None:
        self._call("abort_save", save_id)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self._call("stats")
        return stats

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
