"""A session's cached KV: what it stores (`stored`, `resident`), and deleting a session together
with the cached KV pages only it used.

What a session stores is its user's own pages that its versions' tokens reach, each page once at
its uncompressed size (`KVCache.lookup.stored`); public-prefix pages are no one's. Reading it leaves the
pages' recency alone, and a session deleted meanwhile stores nothing (a listing does not fail
for it).

Deleting: the session's rows go first (one transaction); then its private pages that none of the
user's other versions reach are cut from the index and dropped from this server's tiers (host,
disk, their page rows), then deleted from the remote tier (Redis, `_drop_remote`). Pages shared
with another session of the same user stay (they are that session's cache too), and
public-prefix pages are never touched.

Which pages: those the index holds on the deleted versions' paths (`PrefixIndex.path_pages`),
and every address a save of their tokens can have used (`dss.ops.kv.addresses`: the remote
tier is indexed by no one, and a turn's prompt leaves a tail page no version ends with), less
what a remaining version of the user reaches. In a fleet, the other servers are then told
(`dss.fleet.page_drops`): their page rows of those pages go in that transaction, and each server's
follower drops its own copies within a poll (`apply_fleet_drop`).

Memory follows the session, not the user's history: its versions' token ids are read (no
messages) a few at a time (`iter_tokens`), and when deleting, the user's other versions are
walked the same way, each reduced at once to the pages it shares with the deleted paths.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import numpy as np

from dss.dialogue.versions import VersionStore
from dss.errors import SessionNotFound, TierUnavailable
from dss.fleet.page_drops import PageDrop
from dss.index.fingerprints import FingerprintRegistry
from dss.index.prefix_index import PrefixIndex
from dss.keys.identity import Identity
from dss.namespace import make_namespace
from dss.ops.kv import KVCache, StoredKV
from dss.ops.kv.addresses import PublicSplits, reached_addresses, saved_addresses
from dss.pages.placement import TieredPages
from dss.types import FingerprintId, Namespace, PageHash, SessionId, TenantId, Tier, UserId

log = logging.getLogger("dss.sessions")
# The token ids of the public prefixes registered for a model (`PublicPrefixes.registered`).
PublicPrefixTokens = Callable[[FingerprintId], list[np.ndarray]]
# Tells the other servers of a fleet which pages of a tenant a deletion dropped.
PagesDeleted = Callable[[TenantId, AbstractSet[PageHash]], object]
_SETTLE_S = 30.0


class Sessions:
    """A session's cached KV over the parts that hold it: `stored`, `resident`,
    `resident_versions`, `delete(user, sid)`, and `apply_fleet_drop` (another server's deletion).
    `on_deleted(user, sid)` runs after a deletion (retention forgets the session's hints);
    `pages_deleted(tenant, pages)` (a fleet: `dss.fleet.page_drops.PageDrops.record`) tells the
    other servers which pages to drop."""

    def __init__(
        self,
        versions: VersionStore,
        identity: Identity,
        fingerprints: FingerprintRegistry,
        index: PrefixIndex,
        pages: TieredPages,
        kv: KVCache,
        on_deleted: Callable[[UserId, SessionId], None] = lambda _user, _sid: None,
        public_prefixes: PublicPrefixTokens = lambda _fid: [],
        pages_deleted: PagesDeleted | None = None,
    ) -> None:
        self._versions = versions
        self._identity = identity
        self._fingerprints = fingerprints
        self._index = index
        self._pages = pages
        self._kv = kv
        self._on_deleted = on_deleted
        self._public_prefixes = public_prefixes
        self._pages_deleted = pages_deleted

    def stored(self, user: UserId, sid: SessionId) -> StoredKV:
        """The KV the user's own pages hold for the session's versions (each page once); nothing
        for a session that is not the user's (deleted since it was listed)."""
        try:
            versions = self._versions.iter_tokens(user, sid)
        except SessionNotFound:
            return StoredKV()
        sequences = ((v.fingerprint, v.tokens) for v in versions if v.fingerprint is not None)
        return self._kv.lookup.stored(self._identity.tenant_for(user), sequences)

    def resident(
        self, user: UserId, fingerprint: str | None, tokens: Sequence[int] | np.ndarray
    ) -> dict[str, int]:
        """Tokens of a version of the user whose KV each tier holds now (`KVCache.lookup.residency`);
        every tier 0 for a version of a model this store does not know, or without tokens."""
        return self._resident(self._identity.tenant_for(user), fingerprint, tokens)

    def resident_versions(
        self, user: UserId, sid: SessionId, after: int, through: int
    ) -> dict[int, dict[str, int]]:
        """`resident` of each version of the session numbered in (`after`, `through`] that has
        tokens, by number; the token ids are read a few versions at a time."""
        tenant = self._identity.tenant_for(user)  # once, not per version
        return {
            v.number: self._resident(tenant, v.fingerprint, v.tokens)
            for v in self._versions.iter_tokens(user, sid, after=after, through=through)
        }

    def _resident(
        self, tenant: TenantId, fingerprint: str | None, tokens: Sequence[int] | np.ndarray
    ) -> dict[str, int]:
        if not fingerprint or fingerprint not in self._fingerprints or len(tokens) == 0:
            return {t.value: 0 for t in Tier}
        return self._kv.lookup.residency(FingerprintId(fingerprint), tenant, tokens)

    def delete(self, user: UserId, sid: SessionId, *, epoch: int | None = None) -> int:
        """Delete a session and the cached pages only it used; returns the pages dropped.
        `epoch`: the erasure epoch the request was admitted under (`UserErased` once erased since)."""
        dropped = delete_session(
            self._versions,
            self._identity,
            self._fingerprints,
            self._index,
            self._pages,
            user,
            sid,
            epoch,
            self._public_prefixes,
            self._pages_deleted,
        )
        self._on_deleted(user, sid)
        return dropped

    def apply_fleet_drop(self, drop: PageDrop) -> int:
        """Another server of the fleet deleted a session: this server's copies of its pages go
        (out of the tiers, their rows and the index, with what hangs below them), then out of
        the remote tier once a move of one in flight here settled (a write-behind could put it
        back). Returns the pages that were here. Idempotent."""
        gone = _drop_off_path(self._pages, self._index, frozenset(drop.pages))
        if gone:
            _drop_remote(self._pages, gone, frozenset())
        return len(gone)


def delete_session(
    versions: VersionStore,
    identity: Identity,
    fingerprints: FingerprintRegistry,
    index: PrefixIndex,
    pages: TieredPages,
    user: UserId,
    sid: SessionId,
    epoch: int | None = None,
    public_prefixes: PublicPrefixTokens = lambda _fid: [],
    pages_deleted: PagesDeleted | None = None,
) -> int:
    """Delete session `sid` of `user` and its exclusive pages; returns the pages dropped here.
    After the rows' commit: the pages out of this server's index and tiers, then out of the
    remote tier (`_drop_remote`), then the other servers are told (`pages_deleted`)."""
    drop: dict[FingerprintId, list[np.ndarray]] = defaultdict(list)
    for v in versions.iter_tokens(user, sid):  # SessionNotFound for anyone else
        if v.fingerprint is not None:
            drop[v.fingerprint].append(v.tokens)
    n_versions = versions.delete_session(user, sid, epoch=epoch)
    tenant = identity.tenant_for(user)
    doomed: dict[FingerprintId, _Doomed] = {}
    for fid in drop:
        if fid not in fingerprints:
            continue
        ns, bs = make_namespace(fid, tenant), fingerprints.get(fid).block_size
        splits = _public_splits(index, fid, bs, public_prefixes(fid))
        indexed = frozenset().union(*(index.path_pages(ns, t) for t in drop[fid]))
        saved = frozenset(saved_addresses(ns, drop[fid], bs, splits))
        doomed[fid] = _Doomed(ns, bs, splits, indexed, saved)
    # Of the other paths, only what they share with the deleted ones.
    keep = _kept_pages(versions, index, user, doomed)
    dropped: list[PageHash] = []
    unreached: set[PageHash] = set()
    for fid, d in doomed.items():
        kept = keep[fid]
        if d.indexed:
            dropped.extend(pages.copies.drop(index.remove_paths(d.namespace, drop[fid], kept.indexed)))
        unreached |= d.saved - kept.saved - kept.indexed
    # What the index has of the session off its versions' paths: tails of its turns' prompts.
    dropped.extend(_drop_off_path(pages, index, unreached.difference(dropped)))
    n_remote = _drop_remote(pages, dropped, unreached)
    if pages_deleted is not None:
        pages_deleted(tenant, unreached.union(dropped))
    log.info(
        "deleted a session with %d versions and %d cached pages (remote tier: %s)",
        n_versions,
        len(dropped),
        n_remote,
    )
    return len(dropped)


@dataclass(frozen=True, slots=True)
class _Doomed:
    """Of one model's pages of a deleted session: those the index holds on the deleted paths
    (`indexed`), and every address a save of its versions' tokens can have used (`saved`)."""

    namespace: Namespace
    block_size: int
    splits: PublicSplits
    indexed: frozenset[PageHash]
    saved: frozenset[PageHash]


@dataclass(slots=True)
class _Kept:
    """Of a `_Doomed`'s pages, those a remaining version of the user reaches."""

    indexed: set[PageHash] = field(default_factory=set)
    saved: set[PageHash] = field(default_factory=set)


def _kept_pages(
    versions: VersionStore, index: PrefixIndex, user: UserId, doomed: dict[FingerprintId, _Doomed]
) -> dict[FingerprintId, _Kept]:
    """Of the `doomed` pages, those a remaining version of the user still reaches."""
    keep = {fid: _Kept() for fid in doomed}
    if not doomed:
        return keep
    for v in versions.iter_tokens(user, fingerprints=doomed):
        fid = v.fingerprint
        if fid is None or fid not in doomed:
            continue
        d, k = doomed[fid], keep[fid]
        if len(k.indexed) < len(d.indexed):  # else every deleted page of this model is kept already
            k.indexed |= index.path_pages(d.namespace, v.tokens) & d.indexed
        k.saved |= reached_addresses(d.namespace, v.tokens, d.block_size, d.splits, d.saved)
    return keep


def _public_splits(
    index: PrefixIndex, fid: FingerprintId, bs: int, registered: list[np.ndarray]
) -> PublicSplits:
    """How many leading pages of some tokens a save can have found public: as many as the index
    holds now, and the whole pages of each registered public prefix they start with."""
    prefixes = [p[: len(p) // bs * bs] for p in registered]

    def splits(tokens: np.ndarray) -> set[int]:
        out = {len(index.public_match(fid, tokens[: len(tokens) // bs * bs]))}
        out.update(
            len(p) // bs for p in prefixes if len(p) <= len(tokens) and np.array_equal(tokens[: len(p)], p)
        )
        return out

    return splits


def _drop_off_path(pages: TieredPages, index: PrefixIndex, doomed: AbstractSet[PageHash]) -> list[PageHash]:
    """The pages of `doomed` this server holds, out of its tiers and its index (with what hangs
    below them); returns those that were present."""
    gone = pages.copies.drop(doomed)
    orphans = index.unlink(gone)
    return gone + pages.copies.drop(orphans) if orphans else gone


def _drop_remote(pages: TieredPages, dropped: list[PageHash], unreached: AbstractSet[PageHash]) -> int | str:
    """Delete from the remote tier the pages dropped here and the addresses no remaining version
    reaches; returns how many Redis held ("unavailable" when it did not answer: the copies stay
    until their TTL ends, `RemoteConfig.ttl_s`; 0 without a remote tier). A move of a dropped
    page in flight (a write-behind to Redis) is waited for first, so it cannot put it back."""
    remote = pages.remote
    if remote is None:
        return 0
    doomed = set(unreached).union(dropped)
    if not pages.table.wait_settled(dropped, _SETTLE_S):
        log.warning("session deletion: some pages were still being moved after %ss", _SETTLE_S)
    try:
        return remote.delete(sorted(doomed))
    except TierUnavailable as exc:
        log.warning("session deletion: the remote tier did not answer (%s); its copies expire by TTL", exc)
        return "unavailable"
