"""Classification rules: which pages a session reaches, and the class each of them gets.

- The pages some branch head's history reaches get the session's class (`PINNED` within the caps,
  `EVICT`, or `NORMAL`); pages only versions off every branch reach (after a rollback) get
  `ORPHAN`. Public prefix pages are never classed (they have their own pins).
- A session's pages are found by matching only the versions whose pages no other version's match
  covers (a version's tokens are a prefix of its children's): branch heads, and the leaves off
  every branch; never every version of the session.
- `pinned` is bounded by `RetentionConfig.pinned_fraction` of the host tier for all users together
  and `pinned_user_fraction` per user: a hint beyond is refused (`check_caps`), and pages a pinned
  session grows past the caps later are not pinned (`pin_within_caps`, older pages first).

No state and no lock: `SessionPageReader` reads the database (`VersionStore`), the index
(`KVCache.match`) and the page table; the rules are pure functions of what it read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass

import numpy as np

from dss.config import RetentionConfig
from dss.dialogue.versions import SessionInfo, VersionStore
from dss.errors import DSSError, PinnedCapExceeded
from dss.index.fingerprints import FingerprintRegistry
from dss.ops.kv import KVCache
from dss.pages.eviction import RetentionClass
from dss.pages.table import PageTable
from dss.types import PUBLIC_TENANT, FingerprintId, PageHash, SessionId, TenantId, UserId

log = logging.getLogger("dss.retention")

_CLASS_OF_LIVE_PAGES = {
    "pinned": RetentionClass.NORMAL,  # the pages within the caps are PINNED instead
    "normal": RetentionClass.NORMAL,
    "evict": RetentionClass.EVICT,
}


@dataclass(frozen=True, slots=True)
class SessionPages:
    """A session's pages, collected from its versions (page -> bytes, in version order)."""

    live: dict[PageHash, int]  # reached from a branch head
    orphan: dict[PageHash, int]  # reached only from versions off every branch


@dataclass(frozen=True, slots=True)
class VersionPage:
    """One stored page of a version's tokens."""

    page: PageHash
    nbytes: int
    tokens: int  # the last page of a version may hold fewer tokens than a block


def classes_for(retention: str, pages: SessionPages, pinned: Set[PageHash]) -> dict[PageHash, RetentionClass]:
    """The class a session with hint `retention` gives each of its pages."""
    mine = dict.fromkeys(pages.orphan, RetentionClass.ORPHAN)
    for h in pages.live:
        mine[h] = RetentionClass.PINNED if h in pinned else _CLASS_OF_LIVE_PAGES[retention]
    return mine


def pinned_caps(config: RetentionConfig, host_capacity_bytes: int) -> tuple[int, int]:
    """(bytes all pinned sessions may hold, bytes one user's may hold) in the host tier."""
    return (
        int(host_capacity_bytes * config.pinned_fraction),
        int(host_capacity_bytes * config.pinned_user_fraction),
    )


def check_caps(
    sid: SessionId,
    want: Mapping[PageHash, int],
    others: Mapping[PageHash, int],
    users: Set[PageHash],
    caps: tuple[int, int],
) -> None:
    """Raise `PinnedCapExceeded` when pinning `want` (page -> bytes) would pass a cap. `others`:
    the pages other sessions pin (page -> bytes); `users`: those of them the same user pins."""
    cap_all, cap_user = caps
    total = sum({**others, **want}.values())
    mine = sum({**{h: others[h] for h in users}, **want}.values())
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


def pin_within_caps(
    sid: SessionId,
    live: Mapping[PageHash, int],
    others: Mapping[PageHash, int],
    users: Set[PageHash],
    caps: tuple[int, int],
) -> frozenset[PageHash]:
    """The live pages of a pinned session that stay pinned: in version order (older pages
    first) until a cap is reached. A page another session pins already costs nothing more."""
    cap_all, cap_user = caps
    left_all = cap_all - sum(others.values())
    left_user = cap_user - sum(others[h] for h in users)
    out: set[PageHash] = set()
    for h, n in live.items():
        if h in others:
            out.add(h)
            if h not in users:
                left_user -= n
            continue
        if n > left_all or n > left_user:
            log.debug("session %r outgrew the pinned caps; its newer pages are not pinned", sid)
            break
        out.add(h)
        left_all -= n
        left_user -= n
    return frozenset(out)


class SessionPageReader:
    """Reads which stored pages a session's versions reach (no lock held, no state)."""

    def __init__(
        self,
        versions: VersionStore,
        tenant_for: Callable[[UserId], TenantId],
        fingerprints: FingerprintRegistry,
        kv: KVCache,
        table: PageTable,
    ) -> None:
        self._versions = versions
        self._tenant_for = tenant_for
        self._fingerprints = fingerprints
        self._kv = kv
        self._table = table

    def collect(self, user: UserId, sid: SessionId, info: SessionInfo) -> SessionPages:
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
                    for page in self.version_pages(tenant, v.fingerprint, tokens[n], n):
                        out.setdefault(page.page, page.nbytes)
        return SessionPages(live, {h: n for h, n in off.items() if h not in live})

    def version_pages(
        self, tenant: TenantId, fingerprint: str | None, tokens: np.ndarray, number: int
    ) -> list[VersionPage]:
        """Each stored page of a version's tokens, pages of the public namespace left out (whole
        public pages and a public tail page alike; they have their own pins)."""
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
        out: list[VersionPage] = []
        for h, n in zip(m.pages, sizes, strict=True):
            e = self._table.get(h)
            if e is not None and e.meta.tenant != PUBLIC_TENANT:
                out.append(VersionPage(h, fp.page_nbytes, n))
        return out
