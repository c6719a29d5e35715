"""Warm-ups: promoting a version's disk pages into the host tier, off the caller's thread.

`warm` (the API's warm-up route) reads the version, queues promotions of its disk pages and
answers at once with what it found (`WarmPlan`); a pinned session's disk pages are queued the same
way when it is reclassified (`queue`). Each page is queued once however many warm-ups ask for it,
at most `RetentionConfig.max_warm_pages` at a time (more are skipped and counted), and promoted
on `warm_threads` threads of their own: a promotion blocked on the disk blocks no hint, sweep or
request. A promotion leases the page first, so nothing evicts it while it is read.

Lock: `Warmer._lock` is a leaf around the pages in flight, the counters and the closed flag. The
database, the index and the tiers are called with no lock held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dss.config import RetentionConfig
from dss.dialogue.versions import MAIN_BRANCH, VersionStore
from dss.index.fingerprints import FingerprintRegistry
from dss.ops.kv import KVCache
from dss.ops.retention.classes import SessionPageReader
from dss.ops.retention.registry import RetentionRegistry
from dss.pages.placement import TieredPages
from dss.types import PageHash, SessionId, TenantId, Tier, UserId

log = logging.getLogger("dss.retention")


@dataclass(frozen=True, slots=True)
class WarmPlan:
    """What a warm-up found and started: the version's pages, where their tokens are now (fastest
    copy, before the warm-up), and how many pages it queued for promotion from disk."""

    session_id: SessionId
    version: int  # 0: the branch has no version (nothing to warm)
    pages: int
    tokens: int
    resident: dict[str, int]  # tokens per tier now
    warming_pages: int  # queued by this call
    warming_tokens: int
    already_warming: int  # pages another warm-up is promoting already
    skipped_pages: int  # not queued: too many warm-ups in flight


class Warmer:
    def __init__(
        self,
        config: RetentionConfig,
        versions: VersionStore,
        tenant_for: Callable[[UserId], TenantId],
        fingerprints: FingerprintRegistry,
        reader: SessionPageReader,
        registry: RetentionRegistry,
        kv: KVCache,
        pages: TieredPages,
    ) -> None:
        self._config = config
        self._versions = versions
        self._tenant_for = tenant_for
        self._fingerprints = fingerprints
        self._reader = reader
        self._registry = registry
        self._kv = kv
        self._pages = pages
        self._lock = threading.Lock()
        self._warming: set[PageHash] = set()
        self._counts = {"warmed_pages": 0, "warm_skipped_pages": 0}
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=config.warm_threads, thread_name_prefix="dss-warm")

    def warm(
        self, user: UserId, sid: SessionId, *, version: int | None = None, branch: str | None = None
    ) -> WarmPlan:
        """Start promoting a version's disk pages into the host tier and return at once with what
        was found and queued. `version`, else `branch`'s head (default `main`). Raises
        `SessionNotFound`, `VersionNotFound`, `BranchNotFound`."""
        started = time.monotonic()
        number = version
        if number is None:
            number = self._versions.get_branch(user, sid, branch or MAIN_BRANCH).head_version
        empty = WarmPlan(sid, number, 0, 0, {t.value: 0 for t in Tier}, 0, 0, 0, 0)
        if number == 0:
            return empty
        v = self._versions.get_version(user, sid, number)
        self._registry.touch((user, sid), started)
        if not v.fingerprint or v.fingerprint not in self._fingerprints:
            return empty
        pages = self._reader.version_pages(self._tenant_for(user), v.fingerprint, v.tokens, v.number)
        resident = {t.value: 0 for t in Tier}
        on_disk: dict[PageHash, int] = {}
        for p in pages:
            tier = self._pages.fastest_tier(p.page)
            if tier is not None:
                resident[tier.value] += p.tokens
            if tier is Tier.DISK:
                on_disk[p.page] = p.tokens
        queued, already, skipped = self.queue(list(on_disk))
        warming = sum(on_disk[h] for h in queued)
        tokens = sum(p.tokens for p in pages)
        return WarmPlan(sid, number, len(pages), tokens, resident, len(queued), warming, already, skipped)

    def queue(self, pages: list[PageHash]) -> tuple[list[PageHash], int, int]:
        """Queue promotions of `pages` (each page once); (queued, already warming, skipped)."""
        queued: list[PageHash] = []
        already = skipped = 0
        with self._lock:
            if self._closed:
                return [], 0, len(pages)
            for h in pages:
                if h in self._warming:
                    already += 1
                elif len(self._warming) >= self._config.max_warm_pages:
                    skipped += 1
                else:
                    self._warming.add(h)
                    queued.append(h)
            self._counts["warm_skipped_pages"] += skipped
        for i, h in enumerate(queued):
            try:
                self._executor.submit(self._promote, h)
            except RuntimeError:  # closing: the rest are not warmed
                with self._lock:
                    self._warming.difference_update(queued[i:])
                return queued[:i], already, skipped + len(queued) - i
        return queued, already, skipped

    def _promote(self, page: PageHash) -> None:
        gone: list[PageHash] = []
        ok = False
        try:
            held = self._pages.table.lease_prefix([page])  # no eviction while it is promoted
            try:
                ok = bool(held) and self._pages.promoter.promote_to_host(page, gone) is not None
            finally:
                self._pages.unlease(held)
        except Exception:
            log.exception("warm-up of a page failed")
        finally:
            self._kv.lookup.forget(gone)
            with self._lock:
                self._warming.discard(page)
                if ok:
                    self._counts["warmed_pages"] += 1

    def idle(self, timeout_s: float = 30.0) -> bool:
        """Wait until no warm-up is in flight (tests, benchmarks). True when none is."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._warming:
                    return True
            time.sleep(0.01)
        return False

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"warming_pages": len(self._warming), **self._counts}

    def close(self) -> None:
        """Queue nothing more; cancel queued promotions and wait for the running ones."""
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
