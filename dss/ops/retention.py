"""Session retention hints and warm-up: which KV pages stay in the host tier, and which go first.

Each session carries a hint (`kv_retention`: `pinned`, `normal` or `evict`) and an optional idle
TTL (`kv_idle_ttl_s`), stored on its row (`VersionStore.set_retention`). This module turns them
into page retention classes (`dss.pages.eviction.RetentionClass`) and tier moves:

- the pages some branch head's history reaches get the session's class (`PINNED` within the
  caps, `EVICT`, or `NORMAL`); pages only versions off every branch reach (after a rollback) get
  `ORPHAN`. A page several sessions reach keeps the highest class any of them gives it; public
  prefix pages are never classed here (they have their own pins).
- `evict`: the session's host pages move to disk now (`TieredPages.demote_to_disk`) and are the
  first eviction candidates after orphans.
- an idle TTL: once the session was neither updated nor warmed for that long, the sweeper moves
  its host pages to disk (when a disk tier exists) instead of letting them compete with active
  sessions. A page another, active session also reaches stays.
- `pinned`: the pages are never evicted (in any tier) while pinned, and are warmed into the host
  tier; bounded by `RetentionConfig.pinned_fraction` of the host tier for all users together and
  `pinned_user_fraction` per user (`PinnedCapExceeded` beyond; pages a pinned session grows past
  the cap later stay `NORMAL`).
- warm-up (`warm`): promote a version's disk pages into the host tier on a bounded
  executor, each page once however many warm-ups ask for it.

Classes are refreshed for every session the database says was updated since the last sweep (a
commit, a rollback, a new branch, a new hint all update it), so they follow rollbacks within a
sweep interval; a hint set through `set_hint` applies before it returns. A refresh matches only the
versions whose pages no other version's match covers (a version's tokens are a prefix of its
children's): branch heads, and the leaves off every branch; never every version of the session.

What the registry keeps: sessions with a hint (not `normal`, or an idle TTL) with their pages, and
of a `normal` session without a TTL only its orphan pages, for at most `_MAX_ORPHAN_ONLY_PAGES`
pages over all such sessions (the oldest are dropped first: their pages go back to `NORMAL`). A
page a `normal` session reaches from a branch head is not recorded for it: it keeps the default
class unless a hinted session gives it another (an `evict` session sharing a prefix with a
`normal` one can demote the shared pages; they stay served, from disk). An erased user is
remembered for `_ERASED_MEMORY_S`: a warm-up or refresh that read their data before the erasure
does not record anything for them afterwards.

Lock: `SessionRetention._lock` is a leaf around the registry (per session: hint, pages by class; per page:
the class each session gives it), the warm-ups in flight and the last-use times. The database
(`VersionStore`), the index (`KVCache.match`) and the tiers (`TieredPages`) are called with no lock
held. Order of calls, never nested: versions → kv.match → own lock → pages → kv.forget.

Serialisation: every reclassification and demotion runs on one worker thread (`dss-retention`):
`set_hint` and the sweeper submit to it and wait, so two reclassifications never interleave their
writes to the page table. The sweeper submits one job per session (a reclassification, or an idle
demotion) and waits for each before it submits the next, so a hint waits behind one session's job
at most, never behind a whole sweep. A hint still queued after `RetentionConfig.wait_s` is
withdrawn (cancelled: nothing of it was applied) and `RetentionBusy` raised; a hint the worker
has started is waited for to its end (its work is that one session's). Warm-ups run on their own
executor (`warm_threads`) and only promote.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import numpy as np

from dss.config import RetentionConfig
from dss.dialogue.versions import MAIN_BRANCH, SessionInfo, VersionStore, check_retention
from dss.errors import DSSError, PinnedCapExceeded, RetentionBusy, SessionNotFound, StoreClosed
from dss.index.fingerprints import FingerprintRegistry
from dss.ops.kv import KVCache
from dss.pages.eviction import RetentionClass
from dss.pages.manager import TieredPages
from dss.types import PUBLIC_TENANT, FingerprintId, PageHash, SessionId, TenantId, Tier, UserId

log = logging.getLogger("dss.retention")

T = TypeVar("T")
SessionKey = tuple[UserId, SessionId]  # (user, session id)

_OVERLAP_S = 2.0  # the sweep re-reads sessions updated this long before its last read
_MAX_ORPHAN_ONLY_PAGES = 1 << 16  # orphan pages remembered for `normal` sessions without a TTL
_ERASED_MEMORY_S = 600.0  # how long an erased user is remembered (late warm-ups/refreshes refused)
_MAX_ERASED = 100_000  # erased users remembered at most (the oldest are dropped first)


class Keep(enum.Enum):
    """`set_hint`'s marker for a field the call leaves as it is."""

    KEEP = "keep"


KEEP = Keep.KEEP


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


@dataclass
class _Tracked:
    """What the registry knows of one session (its pages as of its last reclassification)."""

    retention: str
    idle_ttl_s: int | None
    updated_at: float  # wall-clock seconds of the session's last update
    live: dict[PageHash, int] = field(default_factory=dict)  # reached from a branch head -> bytes
    orphan: dict[PageHash, int] = field(default_factory=dict)  # reached only from versions off every branch
    pinned: frozenset[PageHash] = frozenset()  # the live pages kept pinned (within the caps)
    cold_at: float | None = None  # when its host pages were demoted (idle or evict)


@dataclass(frozen=True, slots=True)
class _Pages:
    """A session's pages, collected from its versions (no lock held)."""

    live: dict[PageHash, int]  # page -> bytes
    orphan: dict[PageHash, int]


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
        self._tenant_for = tenant_for
        self._fingerprints = fingerprints
        self._kv = kv
        self._pages = pages
        self._lock = threading.Lock()
        self._sessions: dict[SessionKey, _Tracked] = {}
        self._refs: dict[PageHash, dict[SessionKey, RetentionClass]] = {}
        self._nbytes: dict[PageHash, int] = {}  # of every page in `_refs`
        self._touched: dict[SessionKey, float] = {}  # wall time of the last warm-up (tracked sessions)
        # `normal` sessions without a TTL that are tracked for their orphan pages only, oldest
        # refresh first, with how many pages each holds (bounded by `_MAX_ORPHAN_ONLY_PAGES`).
        self._orphan_only: OrderedDict[SessionKey, int] = OrderedDict()
        self._orphan_only_pages = 0
        self._erased: dict[UserId, float] = {}  # user -> monotonic time of the erasure, oldest first
        self._warming: set[PageHash] = set()
        self._counts = {"warmed_pages": 0, "warm_skipped_pages": 0, "idle_demotions": 0, "demoted_pages": 0}
        self._closed = False
        self._cursor: datetime | None = None  # the sweep's read position in `updated_at`
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dss-retention")
        self._warmers = ThreadPoolExecutor(max_workers=config.warm_threads, thread_name_prefix="dss-warm")
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the sweeper thread (once; not with `sweep_interval_s` 0)."""
        if self._sweeper is None and self.config.sweep_interval_s > 0:
            self._sweeper = threading.Thread(target=self._run, name="dss-retention-sweeper", daemon=True)
            self._sweeper.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=60)
        self._worker.shutdown(wait=True, cancel_futures=True)
        self._warmers.shutdown(wait=True, cancel_futures=True)

    def _run(self) -> None:
        while True:
            try:
                self.sweep_now()
            except StoreClosed:
                return
            except Exception:
                log.exception("retention sweep failed")
            if self._stop.wait(self.config.sweep_interval_s):
                return

    def _on_worker(self, fn: Callable[..., T], *args: Any, wait: bool = False) -> T:
        """Run `fn` on the worker and return its result. A job still queued after `wait_s` is
        cancelled (it never runs) and `RetentionBusy` raised, unless `wait` (the sweeper's own
        jobs); one the worker has started is waited for to its end."""
        with self._lock:
            if self._closed:
                raise StoreClosed("the store is closed")
        try:
            fut = self._worker.submit(fn, *args)
        except RuntimeError as exc:  # shut down in between
            raise StoreClosed("the store is closed") from exc
        try:
            try:
                return fut.result(timeout=None if wait else self.config.wait_s)
            except TimeoutError:
                if fut.cancel():
                    raise RetentionBusy("the retention worker is busy; nothing was changed, retry") from None
                return fut.result()  # running: one session's work, its outcome is the answer
        except CancelledError as exc:  # the store closed with the job still queued
            raise StoreClosed("the store is closed") from exc

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
        `SessionNotFound`, `InvalidInput`/`LimitExceeded`, `PinnedCapExceeded` (nothing changed)."""
        return self._on_worker(self._set_hint, user, sid, kv_retention, kv_idle_ttl_s)

    def _set_hint(
        self, user: UserId, sid: SessionId, kv_retention: str | Keep, kv_idle_ttl_s: int | Keep | None
    ) -> SessionInfo:
        current = self._versions.get_session(user, sid)
        retention = current.kv_retention if isinstance(kv_retention, Keep) else kv_retention
        ttl = current.kv_idle_ttl_s if isinstance(kv_idle_ttl_s, Keep) else kv_idle_ttl_s
        check_retention(retention, ttl)
        if retention == "pinned":
            self._check_caps(user, sid, self._collect(user, sid, current))
        info = self._versions.set_retention(user, sid, retention, ttl)
        tracked = self._refresh(user, sid, info)
        if tracked is not None and retention == "evict":
            self._demote((user, sid), tracked)
        return info

    def _check_caps(self, user: UserId, sid: SessionId, pages: _Pages) -> None:
        cap_all, cap_user = self._caps()
        with self._lock:
            others = {k: t for k, t in self._sessions.items() if t.retention == "pinned" and k != (user, sid)}
            all_pinned = {h: self._nbytes.get(h, 0) for t in others.values() for h in t.pinned}
            user_pinned = {
                h: self._nbytes.get(h, 0) for k, t in others.items() if k[0] == user for h in t.pinned
            }
        want = pages.live
        total = sum({**all_pinned, **want}.values())
        mine = sum({**user_pinned, **want}.values())
        if total > cap_all:
            raise PinnedCapExceeded(
                f"pinning session {sid!r} would pin {total} bytes of KV, over the cap of {cap_all} bytes "
                "for all sessions"
            )
        if mine > cap_user:
            raise PinnedCapExceeded(
                f"pinning session {sid!r} would pin {mine} bytes of your KV, over the cap of {cap_user} "
                "bytes per user"
            )

    def _caps(self) -> tuple[int, int]:
        host = self._pages.host.capacity_bytes
        return int(host * self.config.pinned_fraction), int(host * self.config.pinned_user_fraction)

    # ------------------------------------------------------------------ classes
    def _collect(self, user: UserId, sid: SessionId, info: SessionInfo) -> _Pages:
        """The session's pages from its versions: those its branch heads' histories reach, and
        those only versions off every branch reach. Public prefix pages are left out.

        A version's tokens are a prefix of its children's, so a child with the same fingerprint
        and at least as many tokens reaches every page of its parent: only the versions no such
        child covers are matched (branch heads that no other head descends from, for the live
        pages; leaves off every branch, for the orphans), never every version."""
        versions = self._versions.list_versions(user, sid)  # summaries: no bodies read
        by_number = {v.number: v for v in versions}
        on_branch: set[int] = set()
        for b in info.branches:
            cur: int | None = b.head_version
            while cur is not None and cur != 0 and cur not in on_branch and cur in by_number:
                on_branch.add(cur)
                cur = by_number[cur].parent
        covered_live: set[int] = set()  # by a child on a branch
        covered: set[int] = set()  # by any child
        for v in versions:
            p = by_number.get(v.parent) if v.parent else None
            if p is None or not v.fingerprint or v.fingerprint != p.fingerprint or v.n_tokens < p.n_tokens:
                continue
            covered.add(p.number)
            if v.number in on_branch:
                covered_live.add(p.number)
        heads = [n for n in sorted(on_branch) if n not in covered_live]
        leaves = [v.number for v in versions if v.number not in on_branch and v.number not in covered]
        tokens = self._versions.version_tokens(user, sid, heads + leaves) if heads or leaves else {}
        tenant = self._tenant_for(user)
        live: dict[PageHash, int] = {}
        off: dict[PageHash, int] = {}
        for numbers, out in ((heads, live), (leaves, off)):
            for n in numbers:
                v = by_number[n]
                if n in tokens:
                    for h, nb, _ in self._version_pages(tenant, v.fingerprint, tokens[n], n):
                        out.setdefault(h, nb)
        return _Pages(live, {h: n for h, n in off.items() if h not in live})

    def _version_pages(
        self, tenant: TenantId, fingerprint: str | None, tokens: np.ndarray, number: int
    ) -> list[tuple[PageHash, int, int]]:
        """(page, bytes, tokens) of each stored page of a version's tokens, pages of the public
        namespace left out (whole public pages and a public tail page alike; they have their own
        pins). The last page may hold fewer tokens than a block."""
        if not fingerprint or len(tokens) == 0 or fingerprint not in self._fingerprints:
            return []
        fid = FingerprintId(fingerprint)
        fp = self._fingerprints.get(fid)
        try:
            m = self._kv.match(fid, tenant, tokens)
        except DSSError as exc:  # e.g. a version longer than the store's sequence limit
            log.debug("no pages for version %d: %s", number, exc)
            return []
        if not m.pages:
            return []
        bs = fp.block_size
        sizes = [bs] * len(m.pages)
        sizes[-1] = m.n_tokens - bs * (len(m.pages) - 1)
        out: list[tuple[PageHash, int, int]] = []
        for h, n in zip(m.pages, sizes, strict=True):
            e = self._pages.table.get(h)
            if e is not None and e.meta.tenant != PUBLIC_TENANT:
                out.append((h, fp.page_nbytes, n))
        return out

    def _refresh(self, user: UserId, sid: SessionId, info: SessionInfo | None = None) -> _Tracked | None:
        """Re-read a session's pages and set their classes (on the worker). None when the
        session is gone (then it is forgotten)."""
        key = (user, sid)
        started = time.monotonic()
        try:
            info = info if info is not None else self._versions.get_session(user, sid)
            pages = self._collect(user, sid, info)
        except SessionNotFound:
            self._forget([key])
            return None
        hinted = info.kv_retention != "normal" or info.kv_idle_ttl_s is not None
        if not hinted:
            if not pages.orphan:
                self._forget([key])  # its pages keep the default class: nothing to remember
                return None
            pages = _Pages({}, pages.orphan)  # only its orphans need a class
        pinned: frozenset[PageHash] = frozenset()
        if info.kv_retention == "pinned":
            pinned = self._pin_within_caps(key, pages.live)
        cls = {
            "pinned": RetentionClass.NORMAL,
            "normal": RetentionClass.NORMAL,
            "evict": RetentionClass.EVICT,
        }
        mine = dict.fromkeys(pages.orphan, RetentionClass.ORPHAN)
        for h in pages.live:
            mine[h] = RetentionClass.PINNED if h in pinned else cls[info.kv_retention]
        tracked = _Tracked(
            retention=info.kv_retention,
            idle_ttl_s=info.kv_idle_ttl_s,
            updated_at=info.updated_at.timestamp(),
            live=pages.live,
            orphan=pages.orphan,
            pinned=pinned,
        )
        with self._lock:
            if self._erased_since(user, started):
                return None  # read before the user's erasure: nothing of it is recorded
            old = self._sessions.get(key)
            if old is not None and old.cold_at is not None and old.cold_at >= tracked.updated_at:
                tracked.cold_at = old.cold_at  # not used since it went cold
            self._sessions[key] = tracked
            affected = self._set_refs(key, old, mine, {**pages.live, **pages.orphan})
            self._orphan_only_pages -= self._orphan_only.pop(key, 0)
            if not hinted:
                self._orphan_only[key] = len(pages.orphan)
                self._orphan_only_pages += len(pages.orphan)
                while self._orphan_only_pages > _MAX_ORPHAN_ONLY_PAGES and len(self._orphan_only) > 1:
                    oldest, n = self._orphan_only.popitem(last=False)
                    self._orphan_only_pages -= n
                    self._touched.pop(oldest, None)
                    gone = self._sessions.pop(oldest, None)
                    if gone is not None:
                        affected |= self._set_refs(oldest, gone, {}, {})
            classes = self._resolve(affected)
        self._pages.set_retention(classes)
        if pinned:
            self._queue_warm([h for h in pinned if self._pages.fastest_tier(h) is Tier.DISK])
        return tracked

    def _pin_within_caps(self, key: SessionKey, live: dict[PageHash, int]) -> frozenset[PageHash]:
        cap_all, cap_user = self._caps()
        with self._lock:
            used_all: set[PageHash] = set()
            used_user: set[PageHash] = set()
            for k, t in self._sessions.items():
                if k != key:
                    used_all |= t.pinned
                    if k[0] == key[0]:
                        used_user |= t.pinned
            sizes = {h: self._nbytes.get(h, 0) for h in used_all}
        left_all = cap_all - sum(sizes.values())
        left_user = cap_user - sum(sizes[h] for h in used_user)
        out: set[PageHash] = set()
        for h, n in live.items():  # in version order: older pages first
            if h in used_all:
                out.add(h)
                if h not in used_user:
                    left_user -= n
                continue
            if n > left_all or n > left_user:
                log.debug("session %r outgrew the pinned caps; its newer pages are not pinned", key[1])
                break
            out.add(h)
            left_all -= n
            left_user -= n
        return frozenset(out)

    def _set_refs(
        self,
        key: SessionKey,
        old: _Tracked | None,
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

    def forget_session(self, user: UserId, sid: SessionId) -> None:
        """The session was deleted: drop it from the registry (its pages' classes follow)."""
        self._submit_quietly(self._forget, [(user, sid)])

    def forget_user(self, user: UserId) -> None:
        """The user was erased: drop their sessions from the registry. On the worker, after any
        reclassification in progress (one that read the user's sessions before the erasure); and
        from now on, for `_ERASED_MEMORY_S`, a warm-up or refresh that read the user's data
        before this call records nothing for them."""
        now = time.monotonic()
        with self._lock:
            self._erased.pop(user, None)
            self._erased[user] = now  # insertion order is erasure order
            for u, t in list(self._erased.items()):
                if now - t <= _ERASED_MEMORY_S and len(self._erased) <= _MAX_ERASED:
                    break
                del self._erased[u]
        self._submit_quietly(self._forget_user, user)

    def _erased_since(self, user: UserId, started: float) -> bool:
        """Caller holds the lock: whether data of `user` read from `started` on may be stale
        (the user was erased since, or the read is older than the erasures remembered)."""
        t = self._erased.get(user)
        return (t is not None and t >= started) or time.monotonic() - started > _ERASED_MEMORY_S

    def _forget_user(self, user: UserId) -> None:
        with self._lock:
            keys = [k for k in {*self._sessions, *self._touched} if k[0] == user]
        self._forget(keys)

    def _forget(self, keys: list[SessionKey]) -> None:
        with self._lock:
            affected: set[PageHash] = set()
            for key in keys:
                old = self._sessions.pop(key, None)
                self._touched.pop(key, None)
                self._orphan_only_pages -= self._orphan_only.pop(key, 0)
                if old is not None:
                    affected |= self._set_refs(key, old, {}, {})
            classes = self._resolve(affected)
        self._pages.set_retention(classes)

    def _submit_quietly(self, fn: Callable[..., object], *args: Any) -> None:
        with self._lock:
            if self._closed:
                return
        with contextlib.suppress(RuntimeError):  # closing
            self._worker.submit(fn, *args)

    # ------------------------------------------------------------------ demotion
    def _demote(self, key: SessionKey, tracked: _Tracked) -> int:
        """Move the session's host pages to disk, except pages an active session also reaches
        (one not cold and not `evict`) and pinned pages. On the worker."""
        now = time.time()
        with self._lock:
            pages = [h for h in (*tracked.live, *tracked.orphan) if self._demotable(h, key)]
            t = self._sessions.get(key)
            if t is not None:
                t.cold_at = now
        gone: list[PageHash] = []
        try:
            moved = self._pages.demote_to_disk(pages, gone)
        finally:
            self._kv.forget(gone)
        with self._lock:
            self._counts["demoted_pages"] += moved
        return moved

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

    def _is_cold(self, key: SessionKey, t: _Tracked) -> bool:
        """Caller holds the lock: demoted and not used since."""
        return t.cold_at is not None and t.cold_at >= max(t.updated_at, self._touched.get(key, 0.0))

    # ------------------------------------------------------------------ sweeping
    def sweep_now(self) -> dict[str, int]:
        """One sweep, driven from the calling thread (the sweeper's; tests call `sweep()`):
        reclassify the sessions updated since the last one, then demote the idle ones. Each
        session's reclassification or demotion is its own job on the worker, so hints get in
        between them."""
        read_at = time.time()
        limit = self.config.sessions_per_sweep
        with self._lock:
            cursor = self._cursor
        hints = self._versions.retention_hints(updated_after=cursor, limit=limit)
        for h in hints:
            self._on_worker(self._refresh, h.user_id, h.session_id, wait=True)
        with self._lock:
            if len(hints) >= limit:
                self._cursor = hints[-1].updated_at  # more to read: go on from there next time
            else:  # caught up; commits land a little after their `updated_at`: read those again
                self._cursor = datetime.fromtimestamp(read_at - _OVERLAP_S, tz=UTC)
            now = time.time()
            idle = [k for k, t in self._sessions.items() if self._is_idle(k, t, now)]
        moved = demoted = 0
        for k in idle:
            n = self._on_worker(self._demote_idle, k, wait=True)
            if n is not None:
                demoted += 1
                moved += n
        return {"reclassified": len(hints), "idle_sessions": demoted, "demoted_pages": moved}

    def _is_idle(self, key: SessionKey, t: _Tracked, now: float) -> bool:
        """Caller holds the lock: past its idle TTL, and not demoted since it was last used."""
        return (
            t.idle_ttl_s is not None
            and t.retention != "pinned"
            and not self._is_cold(key, t)
            and now - max(t.updated_at, self._touched.get(key, 0.0)) >= t.idle_ttl_s
        )

    def _demote_idle(self, key: SessionKey) -> int | None:
        """On the worker: demote the session if it is still idle (a hint or a warm-up may have
        come in since the sweep looked); the pages moved, or None when it was not idle."""
        with self._lock:
            t = self._sessions.get(key)
            if t is None or not self._is_idle(key, t, time.time()):
                return None
            self._counts["idle_demotions"] += 1
        return self._demote(key, t)

    def sweep(self) -> dict[str, int]:
        """Run one sweep now and wait for it."""
        return self.sweep_now()

    # ------------------------------------------------------------------ warm-up
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
        self._touch((user, sid), started)
        if not v.fingerprint or v.fingerprint not in self._fingerprints:
            return empty
        pages = self._version_pages(self._tenant_for(user), v.fingerprint, v.tokens, v.number)
        resident = {t.value: 0 for t in Tier}
        on_disk: dict[PageHash, int] = {}
        for h, _, n in pages:
            tier = self._pages.fastest_tier(h)
            if tier is not None:
                resident[tier.value] += n
            if tier is Tier.DISK:
                on_disk[h] = n
        queued, already, skipped = self._queue_warm(list(on_disk))
        warming = sum(on_disk[h] for h in queued)
        tokens = sum(n for _, _, n in pages)
        return WarmPlan(sid, number, len(pages), tokens, resident, len(queued), warming, already, skipped)

    def _touch(self, key: SessionKey, started: float) -> None:
        """Record a use of a tracked session (what its idle TTL counts from), read at `started`;
        nothing for an untracked one, or for a user erased since."""
        with self._lock:
            if key in self._sessions and not self._erased_since(key[0], started):
                self._touched[key] = time.time()

    def _queue_warm(self, pages: list[PageHash]) -> tuple[list[PageHash], int, int]:
        """Queue promotions of `pages` (each page once); (queued, already warming, skipped)."""
        queued: list[PageHash] = []
        already = skipped = 0
        with self._lock:
            if self._closed:
                return [], 0, len(pages)
            for h in pages:
                if h in self._warming:
                    already += 1
                elif len(self._warming) >= self.config.max_warm_pages:
                    skipped += 1
                else:
                    self._warming.add(h)
                    queued.append(h)
            self._counts["warm_skipped_pages"] += skipped
        for i, h in enumerate(queued):
            try:
                self._warmers.submit(self._promote, h)
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
                ok = bool(held) and self._pages.promote_to_host(page, gone) is not None
            finally:
                self._pages.unlease(held)
        except Exception:
            log.exception("warm-up of a page failed")
        finally:
            self._kv.forget(gone)
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

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict[str, int]:
        with self._lock:
            pinned = {h for t in self._sessions.values() for h in t.pinned}
            return {
                "tracked_sessions": len(self._sessions),
                "tracked_pages": len(self._refs),
                "pinned_pages": len(pinned),
                "pinned_bytes": sum(self._nbytes.get(h, 0) for h in pinned),
                "warming_pages": len(self._warming),
                **self._counts,
            }
