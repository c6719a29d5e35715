"""The retention registry: what the service remembers of sessions and the classes of their pages.

What it keeps: sessions with a hint (not `normal`, or an idle TTL) with their pages, and of a
`normal` session without a TTL only its orphan pages, for at most `_MAX_ORPHAN_ONLY_PAGES` pages
over all such sessions (the oldest are dropped first: their pages go back to `NORMAL`). A page a
`normal` session reaches from a branch head is not recorded for it: it keeps the default class
unless a hinted session gives it another. A page several sessions reach keeps the highest class
any of them gives it. An erased user is remembered for `_ERASED_MEMORY_S`: a warm-up or refresh
that read their data before the erasure records nothing for them afterwards.

Idle and cold: a session is cold once its host pages were demoted (idle or `evict`) and it was
neither updated nor used (warmed) since; it is idle when past its idle TTL and not cold. A page
another session reaches that is neither cold nor `evict` is not demoted for this one.

Lock: `RetentionRegistry._lock` is a leaf around all of it. Nothing here reads the database, the
index or the tiers: callers read first, then record here, then apply the classes it returns to
the page table (`PageTable.set_retention`) with no lock held.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from dss.pages.eviction import RetentionClass
from dss.types import PageHash, SessionId, UserId

SessionKey = tuple[UserId, SessionId]  # (user, session id)

_MAX_ORPHAN_ONLY_PAGES = 1 << 16  # orphan pages remembered for `normal` sessions without a TTL
_ERASED_MEMORY_S = 600.0  # how long an erased user is remembered (late warm-ups/refreshes refused)
_MAX_ERASED = 100_000  # erased users remembered at most (the oldest are dropped first)


@dataclass
class Tracked:
    """What the registry knows of one session (its pages as of its last reclassification)."""

    retention: str
    idle_ttl_s: int | None
    updated_at: float  # wall-clock seconds of the session's last update
    live: dict[PageHash, int] = field(default_factory=dict)  # reached from a branch head -> bytes
    orphan: dict[PageHash, int] = field(default_factory=dict)  # reached only from versions off every branch
    pinned: frozenset[PageHash] = frozenset()  # the live pages kept pinned (within the caps)
    cold_at: float | None = None  # when its host pages were demoted (idle or evict)


class RetentionRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[SessionKey, Tracked] = {}
        self._refs: dict[PageHash, dict[SessionKey, RetentionClass]] = {}
        self._nbytes: dict[PageHash, int] = {}  # of every page in `_refs`
        self._touched: dict[SessionKey, float] = {}  # wall time of the last warm-up (tracked sessions)
        # `normal` sessions without a TTL that are tracked for their orphan pages only, oldest
        # refresh first, with how many pages each holds (bounded by `_MAX_ORPHAN_ONLY_PAGES`).
        self._orphan_only: OrderedDict[SessionKey, int] = OrderedDict()
        self._orphan_only_pages = 0
        self._erased: dict[UserId, float] = {}  # user -> monotonic time of the erasure, oldest first
        self._counts = {"idle_demotions": 0, "demoted_pages": 0}

    # ------------------------------------------------------------------ recording
    def record(
        self,
        key: SessionKey,
        tracked: Tracked,
        mine: dict[PageHash, RetentionClass],
        hinted: bool,
        started: float,
    ) -> dict[PageHash, RetentionClass] | None:
        """Record a session's reclassification, read from `started` (monotonic) on; returns the
        class of every page whose class may have changed, or None when nothing was recorded (the
        user was erased since the read). Not `hinted`: only its orphans are kept, bounded."""
        nbytes = {**tracked.live, **tracked.orphan}
        with self._lock:
            if self._erased_since(key[0], started):
                return None  # read before the user's erasure: nothing of it is recorded
            old = self._sessions.get(key)
            if old is not None and old.cold_at is not None and old.cold_at >= tracked.updated_at:
                tracked.cold_at = old.cold_at  # not used since it went cold
            self._sessions[key] = tracked
            affected = self._set_refs(key, old, mine, nbytes)
            self._orphan_only_pages -= self._orphan_only.pop(key, 0)
            if not hinted:
                self._orphan_only[key] = len(tracked.orphan)
                self._orphan_only_pages += len(tracked.orphan)
                while self._orphan_only_pages > _MAX_ORPHAN_ONLY_PAGES and len(self._orphan_only) > 1:
                    oldest, n = self._orphan_only.popitem(last=False)
                    self._orphan_only_pages -= n
                    self._touched.pop(oldest, None)
                    gone = self._sessions.pop(oldest, None)
                    if gone is not None:
                        affected |= self._set_refs(oldest, gone, {}, {})
            return self._resolve(affected)

    def forget(self, keys: Iterable[SessionKey]) -> dict[PageHash, RetentionClass]:
        """Drop sessions; returns the class of every page whose class may have changed."""
        with self._lock:
            affected: set[PageHash] = set()
            for key in keys:
                old = self._sessions.pop(key, None)
                self._touched.pop(key, None)
                self._orphan_only_pages -= self._orphan_only.pop(key, 0)
                if old is not None:
                    affected |= self._set_refs(key, old, {}, {})
            return self._resolve(affected)

    def keys_of(self, user: UserId) -> list[SessionKey]:
        """The user's sessions the registry knows."""
        with self._lock:
            return [k for k in {*self._sessions, *self._touched} if k[0] == user]

    def remember_erasure(self, user: UserId) -> None:
        """From now on, for `_ERASED_MEMORY_S`, a read of the user's data from before this call
        records nothing (`record`, `touch`)."""
        now = time.monotonic()
        with self._lock:
            self._erased.pop(user, None)
            self._erased[user] = now  # insertion order is erasure order
            for u, t in list(self._erased.items()):
                if now - t <= _ERASED_MEMORY_S and len(self._erased) <= _MAX_ERASED:
                    break
                del self._erased[u]

    def touch(self, key: SessionKey, started: float) -> None:
        """Record a use of a tracked session (what its idle TTL counts from), read at `started`;
        nothing for an untracked one, or for a user erased since."""
        with self._lock:
            if key in self._sessions and not self._erased_since(key[0], started):
                self._touched[key] = time.time()

    def last_use(self, key: SessionKey) -> float | None:
        """Wall time of the session's last recorded use (None: none since it was tracked)."""
        with self._lock:
            return self._touched.get(key)

    # ------------------------------------------------------------------ pins
    def pinned_by_others(self, key: SessionKey) -> tuple[dict[PageHash, int], frozenset[PageHash]]:
        """The pages sessions other than `key` pin (page -> bytes), and those of them sessions
        of the same user pin."""
        with self._lock:
            others = [(k, t) for k, t in self._sessions.items() if k != key and t.pinned]
            sizes = {h: self._nbytes.get(h, 0) for _, t in others for h in t.pinned}
            users = frozenset(h for k, t in others if k[0] == key[0] for h in t.pinned)
        return sizes, users

    # ------------------------------------------------------------------ demotion
    def go_cold(self, key: SessionKey, tracked: Tracked, now: float) -> list[PageHash]:
        """The session's host pages are about to be demoted: mark it cold, and return those of
        its pages no active session (one not cold and not `evict`) reaches and none pins."""
        with self._lock:
            pages = [h for h in (*tracked.live, *tracked.orphan) if self._demotable(h, key)]
            t = self._sessions.get(key)
            if t is not None:
                t.cold_at = now
            return pages

    def idle_sessions(self, now: float) -> list[SessionKey]:
        with self._lock:
            return [k for k, t in self._sessions.items() if self._is_idle(k, t, now)]

    def take_idle(self, key: SessionKey, now: float) -> Tracked | None:
        """The session if it is still idle (a hint or a warm-up may have come in since the sweep
        looked), counted as an idle demotion; None when it is not."""
        with self._lock:
            t = self._sessions.get(key)
            if t is None or not self._is_idle(key, t, now):
                return None
            self._counts["idle_demotions"] += 1
            return t

    def count_demoted(self, pages: int) -> None:
        with self._lock:
            self._counts["demoted_pages"] += pages

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, int]:
        with self._lock:
            pinned = {h for t in self._sessions.values() for h in t.pinned}
            return {
                "tracked_sessions": len(self._sessions),
                "tracked_pages": len(self._refs),
                "pinned_pages": len(pinned),
                "pinned_bytes": sum(self._nbytes.get(h, 0) for h in pinned),
                **self._counts,
            }

    # ------------------------------------------------------------------ under the lock
    def _set_refs(
        self,
        key: SessionKey,
        old: Tracked | None,
        mine: dict[PageHash, RetentionClass],
        nbytes: dict[PageHash, int],
    ) -> set[PageHash]:
        """Caller holds the lock: replace `key`'s class of each page; returns the pages touched."""
        before = set(old.live) | set(old.orphan) if old is not None else set()
        for h in before - mine.keys():
            refs = self._refs.get(h)
            if refs is not None:
                refs.pop(key, None)
                if not refs:
                    del self._refs[h]
                    self._nbytes.pop(h, None)
        for h, c in mine.items():
            self._refs.setdefault(h, {})[key] = c
            self._nbytes[h] = nbytes[h]
        return before | mine.keys()

    def _resolve(self, pages: Iterable[PageHash]) -> dict[PageHash, RetentionClass]:
        """Caller holds the lock: each page's class, the highest any session gives it."""
        out: dict[PageHash, RetentionClass] = {}
        for h in pages:
            refs = self._refs.get(h)
            out[h] = max(refs.values()) if refs else RetentionClass.NORMAL
        return out

    def _erased_since(self, user: UserId, started: float) -> bool:
        """Caller holds the lock: whether data of `user` read from `started` on may be stale
        (the user was erased since, or the read is older than the erasures remembered)."""
        t = self._erased.get(user)
        return (t is not None and t >= started) or time.monotonic() - started > _ERASED_MEMORY_S

    def _demotable(self, page: PageHash, key: SessionKey) -> bool:
        """Caller holds the lock."""
        for k, c in self._refs.get(page, {}).items():
            if c is RetentionClass.PINNED:
                return False
            if k == key or c is RetentionClass.ORPHAN:  # an orphan claim keeps nothing on the host
                continue
            other = self._sessions.get(k)
            if other is None or (other.retention != "evict" and not self._is_cold(k, other)):
                return False
        return True

    def _is_cold(self, key: SessionKey, t: Tracked) -> bool:
        """Caller holds the lock: demoted and not used since."""
        return t.cold_at is not None and t.cold_at >= max(t.updated_at, self._touched.get(key, 0.0))

    def _is_idle(self, key: SessionKey, t: Tracked, now: float) -> bool:
        """Caller holds the lock: past its idle TTL, and not demoted since it was last used."""
        return (
            t.idle_ttl_s is not None
            and t.retention != "pinned"
            and not self._is_cold(key, t)
            and now - max(t.updated_at, self._touched.get(key, 0.0)) >= t.idle_ttl_s
        )
