"""A session's cached KV: what it stores (`stored`, `resident`), and deleting a session together
with the cached KV pages only it used.

What a session stores is its user's own pages that its versions' tokens reach, each page once at
its uncompressed size (`KVCache.stored`); public-prefix pages are no one's. Reading it leaves the
pages' recency alone, and a session deleted meanwhile stores nothing (a listing does not fail
for it).

Deleting: the session's rows go first (one transaction); then its private pages that none of the
user's other versions reach are cut from the index and dropped from every tier. Pages shared with
another session of the same user stay (they are that session's cache too), and public-prefix
pages are never touched.

Memory follows the session, not the user's history: its versions' token ids are read (no
messages) a few at a time (`iter_tokens`), and when deleting, the user's other versions are
walked the same way, each reduced at once to the pages it shares with the deleted paths.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from dss.dialogue.versions import VersionStore
from dss.errors import SessionNotFound
from dss.index.fingerprints import FingerprintRegistry
from dss.index.prefix_index import PrefixIndex
from dss.keys.identity import Identity
from dss.namespace import make_namespace
from dss.ops.kv import KVCache, StoredKV
from dss.pages.tiered import TieredPages
from dss.types import FingerprintId, Namespace, PageHash, SessionId, TenantId, Tier, UserId

log = logging.getLogger("dss.sessions")


class Sessions:
    """A session's cached KV over the parts that hold it: `stored`, `resident`,
    `resident_versions`, and `delete(user, sid)`. `on_deleted(user, sid)` runs after a deletion
    (retention forgets the session's hints)."""

    def __init__(
        self,
        versions: VersionStore,
        identity: Identity,
        fingerprints: FingerprintRegistry,
        index: PrefixIndex,
        pages: TieredPages,
        kv: KVCache,
        on_deleted: Callable[[UserId, SessionId], None] = lambda _user, _sid: None,
    ) -> None:
        self._versions = versions
        self._identity = identity
        self._fingerprints = fingerprints
        self._index = index
        self._pages = pages
        self._kv = kv
        self._on_deleted = on_deleted

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
        """Tokens of a version of the user whose KV each tier holds now (`KVCache.residency`);
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
            self._versions, self._identity, self._fingerprints, self._index, self._pages, user, sid, epoch
        )
        self._on_deleted(user, sid)
        return dropped


def delete_session(
    versions: VersionStore,
    identity: Identity,
    fingerprints: FingerprintRegistry,
    index: PrefixIndex,
    pages: TieredPages,
    user: UserId,
    sid: SessionId,
    epoch: int | None = None,
) -> int:
    """Delete session `sid` of `user` and its exclusive pages; returns the pages dropped."""
    drop: dict[FingerprintId, list[np.ndarray]] = defaultdict(list)
    for v in versions.iter_tokens(user, sid):  # SessionNotFound for anyone else
        if v.fingerprint is not None:
            drop[v.fingerprint].append(v.tokens)
    n_versions = versions.delete_session(user, sid, epoch=epoch)
    tenant = identity.tenant_for(user)
    spaces = {fid: make_namespace(fid, tenant) for fid in drop if fid in fingerprints}
    # The pages the deleted paths reach; of the other paths, only what they share with these.
    doomed: dict[FingerprintId, frozenset[PageHash]] = {}
    for fid, ns in spaces.items():
        doomed[fid] = frozenset().union(*(index.path_pages(ns, t) for t in drop[fid]))
    keep = _kept_pages(versions, index, user, spaces, {f: d for f, d in doomed.items() if d})
    dropped = 0
    for fid, ns in spaces.items():
        if doomed[fid]:
            dropped += len(pages.copies.drop(index.remove_paths(ns, drop[fid], keep[fid])))
    log.info("deleted a session with %d versions and %d cached pages", n_versions, dropped)
    return dropped


def _kept_pages(
    versions: VersionStore,
    index: PrefixIndex,
    user: UserId,
    spaces: dict[FingerprintId, Namespace],
    doomed: dict[FingerprintId, frozenset[PageHash]],
) -> dict[FingerprintId, set[PageHash]]:
    """Of the `doomed` pages, those a remaining version of the user still reaches."""
    keep: dict[FingerprintId, set[PageHash]] = {fid: set() for fid in spaces}
    if not doomed:
        return keep
    for v in versions.iter_tokens(user, fingerprints=doomed):
        fid = v.fingerprint
        if fid is None or fid not in doomed or len(keep[fid]) == len(doomed[fid]):
            continue  # every deleted page of this model is kept already
        keep[fid] |= index.path_pages(spaces[fid], v.tokens) & doomed[fid]
    return keep
