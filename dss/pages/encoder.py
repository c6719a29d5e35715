"""Page-file encoding and decoding in a helper process, off the owner's GIL.

Checksumming, compressing and encrypting a 3 MB page (and the reverse) takes milliseconds of C
code, part of which holds the GIL; in the owner process that time is taken from every lookup and
RPC thread. A helper process does it instead, reading and writing the page bytes directly in the
shared-memory host arena (it attaches the arena by the slot's path), and writing the page file as
a temp file that the owner then accounts for and renames into place (`DiskTier.adopt`). Only
small control values cross the pipe: the page metadata, a slot reference, a data key.

The helper is started on first use and restarted if it dies; when it cannot be had, the work runs
in the calling thread, exactly as before (`DiskTier.write`, `DiskTier.read`). Neither a load's
read nor the disk writer waits for a helper to start (`wait_start=False`): the helper starts in
the background, and until it answers the caller does the work itself (`CodecStarting`). A spawned
interpreter's start-up took over 30 s on 2 cores while a TP=2 engine's processes spun: the first
load after a restart waited out its whole load timeout on every rank, then recomputed (issue 31,
item 6), and a turn's commit waited out its durable wait behind the first page write (the CI run
of stop 34). No lock is held while waiting for a helper.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from dss.errors import CorruptPage, DSSError, PageMissing, TierUnavailable
from dss.pages.codec import make_codec
from dss.pages.meta import PageMeta
from dss.pages.pagefile import decode_page, encode_page
from dss.pages.tiers.host.arena import HostArena
from dss.types import PageHash
from dss.wire import SlotRef

log = logging.getLogger("dss.pages.encoder")

_JOB_TIMEOUT_S = 60.0
# Two, so that a promotion (on a request's path) never waits behind the writer's encode; the
# writer submits one page at a time, so it never holds more than one of them.
_WORKERS = 2
_PARENT_POLL_S = 0.5


class CodecStarting(TierUnavailable):
    """No helper has answered yet (they are starting): the caller does the work itself."""


class _Worker:
    """One helper process and its pipe; used by one caller at a time (it is taken from a queue)."""

    answered = False  # it answered a job: its interpreter is up

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc: BaseProcess = ctx.Process(
            target=_serve, args=(child, os.getpid()), name="dss-page-codec", daemon=True
        )
        self.proc.start()
        child.close()

    def call(self, job: tuple[Any, ...]) -> Any:
        self.conn.send(job)
        if not self.conn.poll(_JOB_TIMEOUT_S):
            raise TimeoutError("the page codec process did not answer in time")
        ok, value = self.conn.recv()
        self.answered = True
        if not ok:
            raise value
        return value

    def stop(self, timeout_s: float = 5.0) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.proc.kill()
            self.proc.join(timeout_s)
        self.conn.close()


class PageCodecProcess:
    def __init__(self, codec_name: str, workers: int = _WORKERS) -> None:
        self._codec_name = codec_name
        self._lock = threading.Lock()  # leaf: guards starting workers and closing
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._started = 0
        self._max = workers
        self._all: list[_Worker] = []
        self._closed = False

    def _start_one(self) -> None:
        """Spawn a helper, wait until it answers, then offer it (a background thread)."""
        worker: _Worker | None = None
        try:
            worker = _Worker()
            worker.call(("ping",))
        except Exception as exc:
            with self._lock:
                self._started -= 1
                closed = self._closed
            if not closed:  # closed meanwhile: the helper was stopped on purpose, or exited with us
                log.warning("the page codec process did not start: %s", exc)
            if worker is not None:
                worker.stop(timeout_s=1.0)
            return
        with self._lock:
            closed = self._closed
            if not closed:
                self._all.append(worker)
        if closed:
            worker.stop(timeout_s=1.0)
            return
        self._idle.put(worker)

    def _take(self, wait_start: bool) -> _Worker:
        with self._lock:
            if self._closed:
                raise TierUnavailable("the page codec process is closed")
            start = self._idle.empty() and self._started < self._max
            if start:
                self._started += 1
            any_answered = any(w.answered for w in self._all)
        if not wait_start:  # start a helper in the background, use one that answered
            if start:
                threading.Thread(target=self._start_one, name="dss-page-codec-start", daemon=True).start()
            if not any_answered:
                raise CodecStarting("the page codec process is starting")
        elif start:
            try:
                worker = _Worker()  # spawning runs outside the lock
            except Exception as exc:
                with self._lock:
                    self._started -= 1
                raise TierUnavailable(f"cannot start the page codec process: {exc}") from exc
            with self._lock:
                self._all.append(worker)
            return worker
        try:
            return self._idle.get(timeout=_JOB_TIMEOUT_S)
        except queue.Empty:
            raise TierUnavailable("no page codec process became free in time") from None

    def _run(self, job: tuple[Any, ...], wait_start: bool = True) -> Any:
        worker = self._take(wait_start)
        try:
            result = worker.call(job)
        except DSSError:
            self._idle.put(worker)  # the job failed, the worker is fine
            raise
        except (OSError, EOFError, TimeoutError) as exc:
            self._retire(worker)
            raise TierUnavailable(f"the page codec process failed: {exc}") from exc
        self._idle.put(worker)
        return result

    def _retire(self, worker: _Worker) -> None:
        with self._lock:
            self._started -= 1
            if worker in self._all:
                self._all.remove(worker)
        worker.stop(timeout_s=1.0)

    def wait_ready(self, timeout_s: float) -> bool:
        """Start a helper in the background unless one runs, and wait until one answered (a test
        that must see the helper do the work). True when one did."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self._idle.put(self._take(wait_start=False))
                return True
            except CodecStarting:
                time.sleep(0.05)
        return False

    def encode_to_file(
        self,
        meta: PageMeta,
        ref: SlotRef,
        data_key: bytes | None,
        path: Path,
        fsync: bool,
        wait_start: bool = True,
    ) -> int:
        """Write the page file of the page in slot `ref` to `path` (a new temp file); returns its
        size and sets `meta.checksum` when it was empty. Raises `CorruptPage` when the slot's bytes
        do not match an existing checksum, `TierUnavailable` when the file cannot be written;
        `CodecStarting` when no helper has answered yet and `wait_start` is False (the disk
        writer: it encodes the page itself)."""
        job = ("encode", meta, ref, self._codec_name, data_key, str(path), fsync)
        size, check = self._run(job, wait_start)
        if not meta.checksum:
            meta.checksum = check
        return int(size)

    def decode_file(
        self, path: Path, page: PageHash, data_key: bytes | None, ref: SlotRef, wait_start: bool = True
    ) -> None:
        """Verify and decode the page file at `path` straight into slot `ref`. Raises
        `CorruptPage`, `PageMissing` or `TierUnavailable`; `CodecStarting` when no helper has
        answered yet and `wait_start` is False (a load's read: it decodes the page itself)."""
        self._run(("decode", str(path), page, data_key, ref), wait_start)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for w in workers:
            w.stop()


# ---------------------------------------------------------------------- in the helper process
_arenas: dict[str, HostArena] = {}


def _serve(conn: Connection, parent_pid: int) -> None:
    """The helper's loop: one job at a time until told to stop or the owner is gone."""

    def watch_parent() -> None:  # a `kill -9` of the owner must not leave helpers behind
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    jobs: dict[str, Callable[..., Any]] = {"encode": _encode_job, "decode": _decode_job, "ping": lambda: None}
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        try:
            reply: tuple[bool, Any] = (True, jobs[job[0]](*job[1:]))
        except DSSError as exc:
            reply = (False, exc)
        except Exception as exc:  # reported as a tier failure; the helper keeps serving
            reply = (False, TierUnavailable(f"page codec job failed: {type(exc).__name__}: {exc}"))
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return


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
