"""How the engine's processes yield the CPU to the API's (`DSS_ENGINE__CPU_PRIORITY`).

A CPU engine computes for long stretches on every core it gets; the API answers in a few
milliseconds of CPU. With equal priority a rollback waits behind the engine's time slices (tens of
milliseconds on a 2-core machine). Two ways to put the engine behind the API:

- `idle` (the default, Linux): every thread of the engine's processes runs in the `SCHED_IDLE`
  class. A thread of the API that wakes preempts an idle-class thread at once, where it would wait
  for the end of a niced thread's slice first; the engine still gets every cycle the API leaves.
  On a 2-core machine under `bench/api_load.py` it served a few more requests a second with a
  lower median time to first token than nice 10; the rollbacks' tail moved less than the
  machine's noise (docs/operations.md).
- `nice`: the nice value `DSS_ENGINE__NICE` (0: unchanged), where `SCHED_IDLE` is not available.

Only the processes the engine started are changed, not the store's own helpers (the page codec
decodes on the path of a load). Linux keeps both per thread, so every thread is changed; threads
created later inherit it from their creator.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Literal

import psutil

log = logging.getLogger("dss.api.llm")

CpuPriority = Literal["idle", "nice"]


def child_pids() -> set[int]:
    """The pids of this process's direct children."""
    return {p.pid for p in psutil.Process().children()}


def lower_engine_priority(started_since: set[int], priority: CpuPriority, nice: int) -> None:
    """Put the processes started since `started_since` (`child_pids()` before the engine was
    built), and their descendants, behind the API."""
    engine: list[psutil.Process] = []
    for child in psutil.Process().children():
        if child.pid not in started_since:
            engine.append(child)
            with contextlib.suppress(psutil.Error):  # it ended meanwhile
                engine += child.children(recursive=True)
    threads: list[int] = []
    for proc in engine:
        with contextlib.suppress(psutil.Error):
            threads += [t.id for t in proc.threads()]
    idle = getattr(os, "SCHED_IDLE", None) if priority == "idle" else None
    if priority == "idle" and idle is None:
        log.warning("no SCHED_IDLE class on this platform: the engine runs at nice %d instead", nice)
    refused: list[str] = []
    for tid in threads:
        try:
            if idle is not None:
                os.sched_setscheduler(tid, idle, os.sched_param(0))
            elif nice > 0 and os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:
            refused.append(exc.strerror or type(exc).__name__)
    if refused:  # a container's seccomp policy, say: said, not silently left as it was
        log.warning(
            "the engine's CPU priority (%s) was refused for %d of its %d threads: %s",
            priority,
            len(refused),
            len(threads),
            refused[0],
        )
