"""Monotonic counters per tier, read by the metrics exporter.

Lock: `TierCounters._lock` is a leaf around the counters.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from dss.types import Tier


@dataclass
class TierCounters:
    hits_pages: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    promotions: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    evictions: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    corrupt_pages: int = 0
    disk_write_errors: int = 0
    disk_full_skips: int = 0  # write-throughs skipped: the disk was full of pages it may not evict
    pages_dropped: int = 0
    demoted_pages: int = 0  # host pages moved to disk on request (`demote_to_disk`), not for room
    remote_writes: int = 0  # pages copied to the remote tier (write-behind)
    remote_write_errors: int = 0
    remote_misses: int = 0  # pages a lookup found in the remote tier that were gone when read
    remote_read_bytes: int = 0  # bytes at rest read from the remote tier
    remote_promote_s: float = 0.0  # seconds entering pages read from the remote tier into the host tier
    prefetch_started: int = 0  # prefetches of a turn's pages from the remote tier started
    prefetch_skipped: int = 0  # not started: over `RemoteConfig.prefetch_max_bytes` in flight
    prefetch_pages: int = 0  # pages a prefetch brought into the host tier
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, name: str, tier: Tier | None = None, n: float = 1) -> None:
        with self._lock:
            if tier is None:
                setattr(self, name, getattr(self, name) + n)
            else:
                getattr(self, name)[tier] += n
