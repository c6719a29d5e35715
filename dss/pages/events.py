"""What the page table tells KV-aware routers: which pages this server holds on host and disk.

The page table records one `PageEvent` per tier change of a page, in the order of its changes
(it calls `PageEventLog` under its own lock): `stored` when a page becomes durable in the host
arena (committed by every rank of the engine) or on disk (its file written), `removed` when a tier
lets it go (eviction, demotion, erasure, a corrupt copy). The remote tier is the fleet's, not this
server's, and is not reported. An engine's connector reads the events of its fingerprint over the
RPC (`take`) and publishes them as vLLM KV events (`engine_patch.connector.kv_events`).

Recording is per fingerprint and starts when an engine first asks (`take`); nothing is kept for
a fingerprint no engine reads. Each fingerprint's events have ids 1, 2, 3, ... that never repeat
within this log (`epoch` names the log: a restarted or wiped store has another). The queue is
bounded (`cap`): when it is full the oldest event is dropped and counted, and a reader whose next
event was dropped, or who names another epoch, gets a resync instead of the events it missed: the
table's current holdings for the fingerprint (`PageEventBatch.resync`), which it publishes after
an `AllBlocksCleared`. A reader therefore never holds a view that silently differs from the table.
"""

from __future__ import annotations

import collections
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from dss.types import FingerprintId, Tier
from dss.wire import PageEvent, PageEventBatch

# The tiers a router learns about: this server's own (the remote tier is the fleet's).
REPORTED_TIERS = frozenset({Tier.HOST, Tier.DISK})


@dataclass(slots=True)
class _Queue:
    events: collections.deque[PageEvent]
    next_id: int = 1
    dropped: int = 0


class PageEventLog:
    """Bounded per-fingerprint queues of page events. Not thread-safe on its own: the page table
    calls it under the table's lock (a leaf: nothing here takes a lock or does I/O)."""

    def __init__(self, cap: int = 65536) -> None:
        if cap < 1:
            raise ValueError("the event queue holds at least one event")
        self.cap = cap
        self.epoch = secrets.token_hex(8)
        self._queues: dict[FingerprintId, _Queue] = {}

    def recording(self, fid: FingerprintId) -> bool:
        return fid in self._queues

    def subscribe(self, fid: FingerprintId) -> None:
        """Start recording `fid`'s events (ids continue where they were)."""
        if fid not in self._queues:
            self._queues[fid] = _Queue(collections.deque())

    def record(self, fid: FingerprintId, events: Iterable[PageEvent]) -> None:
        """Append events (their `id` is assigned here) when `fid` is recorded."""
        q = self._queues.get(fid)
        if q is None:
            return
        for ev in events:
            if len(q.events) >= self.cap:
                q.events.popleft()
                q.dropped += 1
            q.events.append(ev.with_id(q.next_id))
            q.next_id += 1

    def last_id(self, fid: FingerprintId) -> int:
        q = self._queues.get(fid)
        return 0 if q is None else q.next_id - 1

    def dropped(self, fid: FingerprintId) -> int:
        q = self._queues.get(fid)
        return 0 if q is None else q.dropped

    def since(self, fid: FingerprintId, epoch: str, after: int, limit: int) -> PageEventBatch | None:
        """The events after id `after` (at most `limit`); None when the reader must resync (it
        names another epoch, has not read yet, or its next event was dropped)."""
        q = self._queues.get(fid)
        if q is None or epoch != self.epoch or after < 0 or after >= q.next_id:
            return None
        oldest = q.events[0].id if q.events else q.next_id
        if after + 1 < oldest:
            return None
        start = after + 1 - oldest
        out = tuple(q.events[i] for i in range(start, min(len(q.events), start + max(1, limit))))
        last = out[-1].id if out else after
        more = last < q.next_id - 1
        return PageEventBatch(self.epoch, out, last, resync=False, dropped=q.dropped, more=more)

    def stats(self) -> dict[str, int]:
        return {
            "event_fingerprints": len(self._queues),
            "events_queued": sum(len(q.events) for q in self._queues.values()),
            "events_dropped": sum(q.dropped for q in self._queues.values()),
        }
