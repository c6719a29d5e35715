"""The retention worker: one thread that runs every reclassification and demotion, in turn.

`set_hint` and the sweeper submit to it and wait, so two reclassifications never interleave
their writes to the page table. A job still queued after `wait_s` is withdrawn (cancelled:
nothing of it ran) and `RetentionBusy` raised, unless the caller waits to the end (the sweeper's
own jobs); a job the thread has started is waited for to its end (its work is one session's).

Lock: `RetentionWorker._lock` is a leaf around the closed flag only; jobs run with no lock held.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any, TypeVar

from dss.errors import RetentionBusy, StoreClosed

T = TypeVar("T")


class RetentionWorker:
    def __init__(self, wait_s: float) -> None:
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dss-retention")

    def run(self, fn: Callable[..., T], *args: Any, wait: bool = False) -> T:
        """Run `fn` on the worker and return its result. A job still queued after `wait_s` is
        cancelled (it never runs) and `RetentionBusy` raised, unless `wait`; one the worker has
        started is waited for to its end. `StoreClosed` once closed."""
        fut = self.submit(fn, *args)
        try:
            try:
                return fut.result(timeout=None if wait else self._wait_s)
            except TimeoutError:
                if fut.cancel():
                    raise RetentionBusy("the retention worker is busy; nothing was changed, retry") from None
                return fut.result()  # running: one session's work, its outcome is the answer
        except CancelledError as exc:  # the store closed with the job still queued
            raise StoreClosed("the store is closed") from exc

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue `fn` and return its future (`run` waits for it; tests hold the worker busy)."""
        with self._lock:
            if self._closed:
                raise StoreClosed("the store is closed")
        try:
            return self._executor.submit(fn, *args)
        except RuntimeError as exc:  # shut down in between
            raise StoreClosed("the store is closed") from exc

    def submit_quietly(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue `fn` without waiting; nothing once closed."""
        with contextlib.suppress(StoreClosed):
            self.submit(fn, *args)

    def close(self) -> None:
        """Refuse new jobs, cancel the queued ones and wait for the running one."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
