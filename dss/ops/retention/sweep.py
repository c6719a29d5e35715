"""The idle sweep: reclassifying the sessions updated since the last sweep, then demoting idle ones.

Every `RetentionConfig.sweep_interval_s` (on its own thread, `dss-retention-sweeper`; or when
`sweep` is called) the sweeper reads the sessions the database says were updated since its last
read (a commit, a rollback, a new branch, a new hint all update a session), at most
`sessions_per_sweep` of them, and has each reclassified; so classes follow rollbacks within a
sweep interval. Then it has every idle session (past its idle TTL, not used since) demoted: its
host pages move to disk (when a disk tier exists) instead of competing with active sessions.

Each session's reclassification or demotion is its own job on the retention worker, submitted
only once the previous one is done, so a hint waits behind one session's job at most, never
behind a whole sweep.

Lock: `IdleSweeper._lock` is a leaf around the read position (`updated_at` cursor).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

from dss.config import RetentionConfig
from dss.dialogue.versions import VersionStore
from dss.errors import StoreClosed
from dss.ops.retention.registry import RetentionRegistry, SessionKey, Tracked
from dss.ops.retention.worker import RetentionWorker
from dss.types import SessionId, UserId

log = logging.getLogger("dss.retention")

_OVERLAP_S = 2.0  # the sweep re-reads sessions updated this long before its last read

Reclassify = Callable[[UserId, SessionId], object]
Demote = Callable[[SessionKey, Tracked], int]


class IdleSweeper:
    def __init__(
        self,
        config: RetentionConfig,
        versions: VersionStore,
        registry: RetentionRegistry,
        worker: RetentionWorker,
        reclassify: Reclassify,
        demote: Demote,
    ) -> None:
        self._config = config
        self._versions = versions
        self._registry = registry
        self._worker = worker
        self._reclassify = reclassify
        self._demote = demote
        self._lock = threading.Lock()
        self._cursor: datetime | None = None  # the sweep's read position in `updated_at`
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the sweeper thread (once; not with `sweep_interval_s` 0)."""
        if self._thread is None and self._config.sweep_interval_s > 0:
            self._thread = threading.Thread(target=self._run, name="dss-retention-sweeper", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            try:
                self.sweep()
            except StoreClosed:
                return
            except Exception:
                log.exception("retention sweep failed")
            if self._stop.wait(self._config.sweep_interval_s):
                return

    def sweep(self) -> dict[str, int]:
        """One sweep, driven from the calling thread: reclassify the sessions updated since the
        last one, then demote the idle ones, each session a job of its own on the worker."""
        read_at = time.time()
        limit = self._config.sessions_per_sweep
        with self._lock:
            cursor = self._cursor
        hints = self._versions.retention_hints(updated_after=cursor, limit=limit)
        for h in hints:
            self._worker.run(self._reclassify, h.user_id, h.session_id, wait=True)
        with self._lock:
            if len(hints) >= limit:
                self._cursor = hints[-1].updated_at  # more to read: go on from there next time
            else:  # caught up; commits land a little after their `updated_at`: read those again
                self._cursor = datetime.fromtimestamp(read_at - _OVERLAP_S, tz=UTC)
        moved = demoted = 0
        for k in self._registry.idle_sessions(time.time()):
            n = self._worker.run(self._demote_idle, k, wait=True)
            if n is not None:
                demoted += 1
                moved += n
        return {"reclassified": len(hints), "idle_sessions": demoted, "demoted_pages": moved}

    def _demote_idle(self, key: SessionKey) -> int | None:
        """On the worker: demote the session if it is still idle; the pages moved, or None when
        it was not idle."""
        t = self._registry.take_idle(key, time.time())
        return None if t is None else self._demote(key, t)
