"""The transport of the local RPC: where the socket lives, its authkey, kernel I/O bounds, and
the errors a caller sees (`StoreUnavailable`, `StoreTimeout`).

Only control messages cross the socket (token ids, page hashes, slot numbers); page bytes move
through the host tier's shared-memory arena. The framing is `multiprocessing.connection`'s over a
unix socket, with its HMAC challenge (`authkey`).
"""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import struct
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path

from dss.errors import DSSError

MAX_UNIX_PATH = 107  # sun_path is 108 bytes on Linux, NUL included


class StoreUnavailable(DSSError):
    """The store's owner process cannot be reached; callers treat it as a cache miss."""


class StoreTimeout(StoreUnavailable):
    """The owner did not answer within the call's deadline; callers treat it as a cache miss."""


class DeadlineMissed(Exception):
    """Within the RPC package: a connect, handshake, send or reply missed the call's deadline."""


def socket_path_for(run_dir: Path) -> str:
    """Where a store in `run_dir` listens: `run_dir/store.sock`, or, when that path is over the
    unix-socket limit (a deep data directory), a private folder of ours in the temp directory
    named by the run dir's hash, so the address stays stable across restarts. That folder is
    created 0700 and refused if it exists and is not ours or not private (planted by another
    local user)."""
    preferred = run_dir / "store.sock"
    if len(os.fsencode(str(preferred))) <= MAX_UNIX_PATH:
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


def set_io_timeouts(sock: socket.socket, seconds: float) -> None:
    """Bound every blocking recv and send syscall on `sock` (kernel SO_RCVTIMEO/SO_SNDTIMEO);
    0 means no bound. An expired bound raises `BlockingIOError` (EAGAIN) in the caller."""
    # at least 1 ms: a real bound must never round down to 0, which means "none"
    usec_total = max(1000, int(seconds * 1_000_000)) if seconds > 0 else 0
    tv = struct.pack("@ll", usec_total // 1_000_000, usec_total % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def set_conn_timeouts(conn: Connection, seconds: float) -> None:
    """`set_io_timeouts` on the socket a `Connection` owns (borrowed, not closed)."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        sock.setblocking(True)
        set_io_timeouts(sock, seconds)
    finally:
        sock.detach()


def check_address(address: str) -> None:
    n = len(os.fsencode(address))
    if n > MAX_UNIX_PATH:
        raise ValueError(f"unix socket path too long ({n} > {MAX_UNIX_PATH} bytes): {address}")
