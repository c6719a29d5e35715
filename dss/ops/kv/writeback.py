"""The background disk writer: write-through of committed pages, off every request's path.

One thread drains a queue of page hashes. Each write claims the page in the page table, then
compresses, encrypts, writes and fsyncs it with no lock held (`TieredPages.write_to_disk`), so a
lookup never waits for the writer's backlog. Pages that a full disk tier evicted on the way are
handed to `forget` (which unlinks them from the index) after the write returns.

The queue is first in, first out: `wait_through(ticket())` waits until every page enqueued before
the call was written (or given up), which is how a turn knows its pages reached the remote tier.
Lock: `_done` (a condition) is a leaf around two counters.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from dss.pages.placement import TieredPages
from dss.types import PageHash

log = logging.getLogger("dss.writeback")


class DiskWriter:
    def __init__(self, pages: TieredPages, forget: Callable[[Sequence[PageHash]], None]) -> None:
        self._pages = pages
        self._forget = forget
        self._queue: queue.Queue[PageHash | None] = queue.Queue()
        self._closed = False
        self._done = threading.Condition(threading.Lock())
        self._enqueued = 0
        self._processed = 0
        self._thread = threading.Thread(target=self._loop, name="dss-disk-writer", daemon=True)
        self._thread.start()

    def enqueue(self, page: PageHash) -> None:
        if not self._closed:
            with self._done:
                self._enqueued += 1
            self._queue.put(page)

    def ticket(self) -> int:
        """How many pages were enqueued so far: `wait_through` of it waits for all of them."""
        with self._done:
            return self._enqueued

    def wait_through(self, ticket: int, deadline: float) -> bool:
        """Wait until the first `ticket` pages enqueued were written (or given up), at most until
        `deadline` (`time.monotonic()`). True when they were."""
        with self._done:
            while self._processed < ticket:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._done.wait(left)
            return True

    @property
    def backlog(self) -> int:
        return self._queue.unfinished_tasks

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until the queue is drained (tests, clean shutdown). True when it was."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self, timeout_s: float = 30.0) -> None:
        if self._closed:
            return
        self.flush(timeout_s)
        self._closed = True
        with self._done:
            self._done.notify_all()  # nobody waits on a closed writer
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        while True:
            page = self._queue.get()
            try:
                if page is None:
                    return
                gone: list[PageHash] = []
                try:
                    self._pages.write_to_disk(page, gone)
                finally:
                    self._forget(gone)
            except Exception:  # the writer must survive anything; the page stays in memory
                log.exception("write-through of a page failed")
            finally:
                if page is not None:
                    with self._done:
                        self._processed += 1
                        self._done.notify_all()
                self._queue.task_done()
