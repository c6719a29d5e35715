"""The background disk writer: write-through of committed pages, off every request's path.

One thread drains a queue of page hashes. Each write claims the page in the page table, then
compresses, encrypts, writes and fsyncs it with no lock held (`TieredPages.write_to_disk`), so a
lookup never waits for the writer's backlog. Pages that a full disk tier evicted on the way are
handed to `forget` (which unlinks them from the index) after the write returns.
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
        self._thread = threading.Thread(target=self._loop, name="dss-disk-writer", daemon=True)
        self._thread.start()

    def enqueue(self, page: PageHash) -> None:
        if not self._closed:
            self._queue.put(page)

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
                self._queue.task_done()
