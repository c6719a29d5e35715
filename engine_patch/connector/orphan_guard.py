"""An engine process whose parent died ends itself.

vLLM's engine-core process does not watch the process that spawned it: after `kill -9` of
`dss serve` (or of any program that built an engine with the DSS connector), the engine core and
its worker kept running, holding their memory and cores (one left behind by a test run held
3.4 GB for half an hour). vLLM's workers already end with the engine core (their death pipe), so
the engine core is the one process that has to watch.

Why polling `os.getppid()` and not `PR_SET_PDEATHSIG`: the death signal fires when the parent
*thread* that spawned the child ends, and engines are started from worker threads that may end
long before the server does.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

_started = False
_lock = threading.Lock()  # a leaf: guards `_started` only


def guard_against_orphaning(poll_s: float = 1.0) -> bool:
    """In a process spawned by `multiprocessing` (vLLM's engine core), start a daemon thread that
    SIGKILLs this process once its parent is gone. Returns whether a guard runs (False in the
    process that built the engine in-process: its parent is not ours to watch). Idempotent."""
    global _started
    if multiprocessing.parent_process() is None:
        return False
    with _lock:
        if _started:
            return True
        _started = True
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.warning("the process that started this engine (pid %d) is gone: ending the engine", parent)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="dss-orphan-guard", daemon=True).start()
    return True
