"""The retention service: session hints applied to the page table, composed of the parts that do it.

`SessionRetention` is what the store and the API call: `set_hint` (persist a session's hint and
apply it before returning), `forget_session` / `forget_user` (deletion and erasure), `stats`, and
its parts as public attributes (`warmer.warm`, `warmer.idle`, `sweeper.sweep`, `sweeper.start`:
callers call the owner). It composes the classification rules (`classes`), the registry of what it
remembers (`registry`), the worker thread every reclassification and demotion runs on (`worker`),
the idle sweep (`sweep`) and the warm-ups (`warmup`); and it holds the two jobs the others share:
a session's reclassification (`_refresh`) and its demotion (`_demote`).

- `evict`: the session's host pages move to disk now (`Demoter.demote_to_disk`, which never
  drops a page) and are the first eviction candidates after orphans.
- an idle TTL: the sweep demotes the session's host pages once it was idle that long.
- `pinned`: the pages are never evicted while pinned (within the caps), and are warmed into the
  host tier.

Locks: none of its own. The registry, the worker, the sweeper and the warmer each have a leaf lock;
none is held while another is taken or while the database (`VersionStore`), the index
(`KVCache.match`, `forget`) or the tiers (`TieredPages`) are called. Order of calls, never nested:
versions → kv.match → registry → pages → kv.lookup.forget.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable

from dss.config import RetentionConfig
from dss.dialogue.versions import SessionInfo, VersionStore, check_retention
from dss.errors import SessionNotFound
from dss.index.fingerprints import FingerprintRegistry
from dss.ops.kv import KVCache
from dss.ops.retention.classes import (
    SessionPageReader,
    SessionPages,
    check_caps,
    classes_for,
    pin_within_caps,
    pinned_caps,
)
from dss.ops.retention.registry import RetentionRegistry, SessionKey, Tracked
from dss.ops.retention.sweep import IdleSweeper
from dss.ops.retention.warmup import Warmer
from dss.ops.retention.worker import RetentionWorker
from dss.pages.placement import TieredPages
from dss.types import PageHash, SessionId, TenantId, Tier, UserId


class Keep(enum.Enum):
    """`set_hint`'s marker for a field the call leaves as it is."""

    KEEP = "keep"


KEEP = Keep.KEEP


class SessionRetention:
    def __init__(
        self,
        config: RetentionConfig,
        versions: VersionStore,
        tenant_for: Callable[[UserId], TenantId],
        fingerprints: FingerprintRegistry,
        kv: KVCache,
        pages: TieredPages,
    ) -> None:
        self.config = config
        self._versions = versions
        self._kv = kv
        self._pages = pages
        self.registry = RetentionRegistry()
        self.worker = RetentionWorker(config.wait_s)
        self._reader = SessionPageReader(versions, tenant_for, fingerprints, kv, pages.table)
        self.warmer = Warmer(
            config, versions, tenant_for, fingerprints, self._reader, self.registry, kv, pages
        )
        self.sweeper = IdleSweeper(config, versions, self.registry, self.worker, self._refresh, self._demote)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self.worker.close()  # first: a sweep in progress stops at its next job (StoreClosed)
        self.sweeper.stop()
        self.warmer.close()

    # ------------------------------------------------------------------ hints
    def set_hint(
        self,
        user: UserId,
        sid: SessionId,
        kv_retention: str | Keep = KEEP,
        kv_idle_ttl_s: int | Keep | None = KEEP,
    ) -> SessionInfo:
        """Set a session's hint and/or idle TTL (KEEP: as it is), persist it and apply it: classes
        now, `evict` demotes the session's host pages now, `pinned` warms them. Raises
        `SessionNotFound`, `InvalidInput`/`LimitExceeded`, `PinnedCapExceeded` (nothing changed),
        `RetentionBusy` (still queued behind other work after `wait_s`: nothing changed)."""
        return self.worker.run(self._set_hint, user, sid, kv_retention, kv_idle_ttl_s)

    def _set_hint(
        self, user: UserId, sid: SessionId, kv_retention: str | Keep, kv_idle_ttl_s: int | Keep | None
    ) -> SessionInfo:
        current = self._versions.get_session(user, sid)
        retention = current.kv_retention if isinstance(kv_retention, Keep) else kv_retention
        ttl = current.kv_idle_ttl_s if isinstance(kv_idle_ttl_s, Keep) else kv_idle_ttl_s
        check_retention(retention, ttl)
        if retention == "pinned":
            others, users = self.registry.pinned_by_others((user, sid))
            want = self._reader.collect(user, sid, current).live
            check_caps(sid, want, others, users, self._caps())
        info = self._versions.set_retention(user, sid, retention, ttl)
        tracked = self._refresh(user, sid, info)
        if tracked is not None and retention == "evict":
            self._demote((user, sid), tracked)
        return info

    def _caps(self) -> tuple[int, int]:
        return pinned_caps(self.config, self._pages.host.capacity_bytes)

    # ------------------------------------------------------------------ jobs (on the worker)
    def _refresh(self, user: UserId, sid: SessionId, info: SessionInfo | None = None) -> Tracked | None:
        """Re-read a session's pages and set their classes. None when the session is gone (then
        it is forgotten) or keeps nothing to remember."""
        key = (user, sid)
        started = time.monotonic()
        try:
            info = info if info is not None else self._versions.get_session(user, sid)
            pages = self._reader.collect(user, sid, info)
        except SessionNotFound:
            self._forget([key])
            return None
        hinted = info.kv_retention != "normal" or info.kv_idle_ttl_s is not None
        if not hinted:
            if not pages.orphan:
                self._forget([key])  # its pages keep the default class: nothing to remember
                return None
            pages = SessionPages({}, pages.orphan)  # only its orphans need a class
        pinned: frozenset[PageHash] = frozenset()
        if info.kv_retention == "pinned":
            others, users = self.registry.pinned_by_others(key)
            pinned = pin_within_caps(sid, pages.live, others, users, self._caps())
        tracked = Tracked(
            retention=info.kv_retention,
            idle_ttl_s=info.kv_idle_ttl_s,
            updated_at=info.updated_at.timestamp(),
            live=pages.live,
            orphan=pages.orphan,
            pinned=pinned,
        )
        classes = self.registry.record(
            key, tracked, classes_for(info.kv_retention, pages, pinned), hinted, started
        )
        if classes is None:
            return None  # read before the user's erasure: nothing of it is recorded
        self._pages.table.set_retention(classes)
        if pinned:
            self.warmer.queue([h for h in pinned if self._pages.fastest_tier(h) is Tier.DISK])
        return tracked

    def _demote(self, key: SessionKey, tracked: Tracked) -> int:
        """Move the session's host pages to disk, except pages an active session also reaches
        (one not cold and not `evict`) and pinned pages."""
        pages = self.registry.go_cold(key, tracked, time.time())
        gone: list[PageHash] = []
        try:
            moved = self._pages.demoter.demote_to_disk(pages, gone)
        finally:
            self._kv.lookup.forget(gone)
        self.registry.count_demoted(moved)
        return moved

    def _forget(self, keys: Iterable[SessionKey]) -> None:
        self._pages.table.set_retention(self.registry.forget(keys))

    def _forget_user(self, user: UserId) -> None:
        self._forget(self.registry.keys_of(user))

    # ------------------------------------------------------------------ deletion and erasure
    def forget_session(self, user: UserId, sid: SessionId) -> None:
        """The session was deleted: drop it from the registry (its pages' classes follow)."""
        self.worker.submit_quietly(self._forget, [(user, sid)])

    def forget_user(self, user: UserId) -> None:
        """The user was erased: drop their sessions from the registry. On the worker, after any
        reclassification in progress (one that read the user's sessions before the erasure); and
        from now on a warm-up or refresh that read the user's data before this call records
        nothing for them."""
        self.registry.remember_erasure(user)
        self.worker.submit_quietly(self._forget_user, user)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, int]:
        return {**self.registry.stats(), **self.warmer.stats()}
