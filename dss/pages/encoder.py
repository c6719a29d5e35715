"""Page-file encoding and decoding in a helper process, off the owner's GIL.

Checksumming, compressing and encrypting a 3 MB page (and the reverse) takes milliseconds of C
code, part of which holds the GIL; in the owner process that time is taken from every lookup and
RPC thread. A helper process does it instead, reading and writing the page bytes directly in the
shared-memory host arena (it attaches the arena by the slot's path), and writing the page file as
a temp file that the owner then accounts for and renames into place (`DiskTier.adopt`). Only
small control values cross the pipe: the page metadata, a slot reference, a data key.

The helper is started on first use and restarted if it dies; when it cannot be had, the work runs
in the calling thread, exactly as before (`DiskTier.write`, `DiskTier.read`). No lock is held
while waiting for it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from dss.errors import CorruptPage, PageMissing, TierUnavailable
from dss.pages.codec import make_codec
from dss.pages.meta import PageMeta
from dss.pages.pagefile import decode_page, encode_page
from dss.pages.tiers.host import HostArena
from dss.types import PageHash
from dss.wire import SlotRef

log = logging.getLogger("dss.pages.encoder")

_JOB_TIMEOUT_S = 60.0
# Two, so that a promotion (on a request's path) never waits behind the writer's encode; the
# writer submits one page at a time, so it never holds more than one of them.
_WORKERS = 2


class PageCodecProcess:
    def __init__(self, codec_name: str) -> None:
        self._codec_name = codec_name
        self._lock = threading.Lock()  # leaf: guards starting and replacing the pool
        self._pool: ProcessPoolExecutor | None = None
        self._closed = False

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise TierUnavailable("the page codec process is closed")
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    max_workers=_WORKERS,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_child_init,
                    initargs=(os.getpid(),),
                )
            return self._pool

    def _run(self, fn: object, *args: object) -> object:
        pool = self._executor()
        try:
            return pool.submit(fn, *args).result(timeout=_JOB_TIMEOUT_S)  # type: ignore[arg-type]
        except BrokenProcessPool as exc:
            with self._lock:
                if self._pool is pool:
                    self._pool = None  # started again by the next call
            raise TierUnavailable(f"the page codec process died: {exc}") from exc

    def encode_to_file(
        self, meta: PageMeta, ref: SlotRef, data_key: bytes | None, path: Path, fsync: bool
    ) -> int:
        """Write the page file of the page in slot `ref` to `path` (a new temp file); returns its
        size and sets `meta.checksum` when it was empty. Raises `CorruptPage` when the slot's bytes
        do not match an existing checksum, `TierUnavailable` when the file cannot be written."""
        size, check = self._run(_encode_job, meta, ref, self._codec_name, data_key, str(path), fsync)  # type: ignore[misc]
        if not meta.checksum:
            meta.checksum = check
        return int(size)

    def decode_file(self, path: Path, page: PageHash, data_key: bytes | None, ref: SlotRef) -> None:
        """Verify and decode the page file at `path` straight into slot `ref`. Raises
        `CorruptPage`, `PageMissing` or `TierUnavailable`."""
        self._run(_decode_job, str(path), page, data_key, ref)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------------- in the helper process
_arenas: dict[str, HostArena] = {}
_PR_SET_PDEATHSIG = 1


def _child_init(parent_pid: int) -> None:
    """Die with the owner: a `kill -9` of the owner must not leave a helper holding its pipes,
    files or arena mappings."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the owner died before the signal was armed
        os._exit(1)


def _slot(ref: SlotRef) -> memoryview:
    arena = _arenas.get(ref.path)
    if arena is None or arena.closed:
        arena = _arenas[ref.path] = HostArena.attach_info(ref.arena)
    return arena.view(ref.slot)


def _encode_job(
    meta: PageMeta, ref: SlotRef, codec_name: str, data_key: bytes | None, path: str, fsync: bool
) -> tuple[int, bytes]:
    blob = encode_page(meta, _slot(ref), make_codec(codec_name), data_key)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise TierUnavailable(f"cannot write {path}: {exc.strerror or exc}") from None
    return len(blob), meta.checksum


def _decode_job(path: str, page: PageHash, data_key: bytes | None, ref: SlotRef) -> None:
    try:
        with open(path, "rb", buffering=0) as f:
            blob = f.read()
    except FileNotFoundError:
        raise PageMissing(f"page {page.hex()} is not on disk") from None
    except OSError as exc:
        raise TierUnavailable(f"cannot read {path}: {exc.strerror or exc}") from None
    import numpy as np

    out = np.frombuffer(_slot(ref), dtype=np.uint8)
    header, _tokens, _raw = decode_page(blob, data_key, out=out)
    if header.page_hash != page:
        raise CorruptPage(f"file of page {page.hex()} holds page {header.page_hash.hex()}")
