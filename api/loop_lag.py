"""How late the server's event loop runs what is ready (`watch_loop_lag`).

Every request's answer passes through the one event loop: while it runs something else (a
stream's tokens, a JSON body, a garbage collection that stops every thread), a ready request
waits. A sleeper that asks to wake after `interval_s` and wakes later measures that wait; its
lateness goes to `dss_event_loop_lag_seconds`, the floor under every route's latency (issue 31:
what a rollback's p99 is made of under load).
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Histogram

INTERVAL_S = 0.02


async def watch_loop_lag(histogram: Histogram, interval_s: float = INTERVAL_S) -> None:
    """Observe the loop's lateness every `interval_s` until cancelled."""
    while True:
        asked = time.perf_counter()
        await asyncio.sleep(interval_s)
        histogram.observe(max(0.0, time.perf_counter() - asked - interval_s))
