"""Per-user token buckets for requests whose cost a user should not be able to repeat at will.

Used for erasure checks (`DELETE /v1/users/{self}` and `GET /v1/erasures/{id}`, which verify a
receipt: a scan of the database and the tiers for the user's remnants). A bucket holds at most
`burst` tokens and gains `per_minute` a minute; a request takes one or is refused with the
seconds until the next one (`RateLimited`: 429 with Retry-After).

Lock: `_lock` is a leaf around the buckets; nothing else happens under it. Memory: buckets that
would be full again are dropped when the table grows past `max_keys` (a full bucket and no bucket
are the same), so it holds only users who asked recently (at most about twice those).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


class TokenBuckets:
    def __init__(
        self,
        per_minute: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 10_000,
    ) -> None:
        self._rate = per_minute / 60.0  # tokens a second; 0: unlimited
        self._burst = float(burst)
        self._clock = clock
        self._max_keys = max_keys
        self._prune_at = max_keys
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    def take(self, key: str) -> int:
        """Take a token of `key`'s bucket: 0 when there was one, else the whole seconds to wait."""
        if self._rate <= 0:
            return 0
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.get(key, (self._burst, now))
            tokens = min(self._burst, tokens + (now - at) * self._rate)
            if tokens >= 1.0:
                self._buckets[key] = (tokens - 1.0, now)
                if len(self._buckets) > self._prune_at:
                    self._drop_full(now)
                    # Amortised: many users active at once do not make every request prune.
                    self._prune_at = max(self._max_keys, 2 * len(self._buckets))
                return 0
            self._buckets[key] = (tokens, now)
            return max(1, math.ceil((1.0 - tokens) / self._rate))

    def _drop_full(self, now: float) -> None:
        full = [k for k, (t, at) in self._buckets.items() if t + (now - at) * self._rate >= self._burst]
        for k in full:
            del self._buckets[k]
