"""Making SQLite's copies of erased rows go away, and knowing, without blocking, whether they have.

`secure_delete` zeroes freed pages, but only once they are checkpointed from the WAL into the
database file, and the WAL file keeps the frames that held the rows until it is truncated. A
reader holding an old snapshot keeps a checkpoint from finishing (the erased rows then stay in
the WAL file). Once a truncating checkpoint has succeeded, every transaction committed before it
is scrubbed for good; so the scrubber remembers the last receipt committed before its last
success, and a verification asks that instead of checkpointing again.

The erasure scrubs and waits (a few tries, briefly waiting for readers: at most ~1.5 s). A
verification of a receipt not yet covered tries once more, waiting for nobody (busy timeout 0;
if a reader or a writer is in the way it gives up at once), and never while another try runs:
readers and writers of everyone else are not held up by verifications.

State is per process. The store scrubs once when it opens, waiting, before any of its threads
starts (`Eraser.scrub_at_open`): every receipt of an earlier run is covered by that, so verifying
one after a restart never depends on a reader that happens to be active at that moment.
PostgreSQL keeps no WAL copies a client can scrub: `None` there.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import Connection, Engine

from dss.db import receipt_rows
from dss.db.connect import BUSY_TIMEOUT_MS

log = logging.getLogger("dss.erasure")
_ATTEMPTS = 5
_WAIT_MS = 200
_PAUSE_S = 0.1


class WalScrubber:
    """Checkpoints and truncates SQLite's WAL; remembers up to which receipt that succeeded.

    Lock: `_lock` is a leaf around two fields; the database is used outside it.
    """

    def __init__(self, db: Engine) -> None:
        self._db = db
        self._sqlite = db.dialect.name == "sqlite"
        self._lock = threading.Lock()
        self._clean_through = 0  # every receipt up to this seq was committed before a success
        self._tries = 0  # tries running now

    def scrub(self, wait: bool = True) -> bool | None:
        """Checkpoint and truncate the WAL; whether that worked (None: not SQLite). `wait`: retry
        a few times, each waiting briefly for readers (an erasure); else one try that waits for
        nobody, skipped (False) while another try runs."""
        if not self._sqlite:
            return None
        with self._lock:
            if self._tries and not wait:
                return False
            self._tries += 1
        try:
            with self._db.connect() as c:
                # Committed before the checkpoint starts, so covered by its success.
                through = receipt_rows.last_seq_in(c)
                ok = _checkpoint(c, _ATTEMPTS if wait else 1, _WAIT_MS if wait else 0)
        finally:
            with self._lock:
                self._tries = 0  # tries running now
        if ok:
            with self._lock:
                self._clean_through = max(self._clean_through, through)
        elif wait:
            log.warning("erasure: a reader kept the WAL checkpoint from finishing; erased rows may linger")
        return ok

    def scrubbed(self, seq: int) -> bool | None:
        """Whether the WAL is scrubbed of every erasure up to receipt `seq`: known from an earlier
        success, or else tried once now without waiting (None: not SQLite)."""
        if not self._sqlite:
            return None
        with self._lock:
            if self._clean_through >= seq:
                return True
        return bool(self.scrub(wait=False)) and self._covers(seq)

    def _covers(self, seq: int) -> bool:
        with self._lock:
            return self._clean_through >= seq


def _checkpoint(c: Connection, attempts: int, wait_ms: int) -> bool:
    try:
        c.exec_driver_sql(f"PRAGMA busy_timeout={wait_ms}")
        for attempt in range(attempts):
            busy, log_frames, moved = c.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").one()
            if busy == 0 and log_frames == moved:
                return True
            if attempt + 1 < attempts:
                time.sleep(_PAUSE_S)
        return False
    finally:
        c.exec_driver_sql(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
