"""Deleting a session together with the cached KV pages only it used.

The session's rows go first (one transaction); then its private pages that none of the user's
other versions reach are cut from the index and dropped from every tier. Pages shared with
another session of the same user stay (they are that session's cache too), and public-prefix
pages are never touched.

Memory follows the deleted session, not the user's history: its versions' token ids are read
(no messages), and the user's other versions are walked a few at a time (`iter_tokens`), each
reduced at once to the pages it shares with the deleted paths.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

import numpy as np

from dss.dialogue.versions import VersionStore
from dss.index.fingerprints import FingerprintRegistry
from dss.index.prefix_index import PrefixIndex
from dss.keys.identity import Identity
from dss.namespace import make_namespace
from dss.pages.tiered import TieredPages
from dss.types import FingerprintId, Namespace, PageHash, SessionId, UserId

log = logging.getLogger("dss.sessions")


class Sessions:
    """Session deletion over the parts that hold a session: `delete(user, sid)`.
    `on_deleted(user, sid)` runs after it (retention forgets the session's hints)."""

    def __init__(
        self,
        versions: VersionStore,
        identity: Identity,
        fingerprints: FingerprintRegistry,
        index: PrefixIndex,
        pages: TieredPages,
        on_deleted: Callable[[UserId, SessionId], None] = lambda _user, _sid: None,
    ) -> None:
        self._versions = versions
        self._identity = identity
        self._fingerprints = fingerprints
        self._index = index
        self._pages = pages
        self._on_deleted = on_deleted

    def delete(self, user: UserId, sid: SessionId) -> int:
        """Delete a session and the cached pages only it used; returns the pages dropped."""
        dropped = delete_session(
            self._versions, self._identity, self._fingerprints, self._index, self._pages, user, sid
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
) -> int:
    """Delete session `sid` of `user` and its exclusive pages; returns the pages dropped."""
    drop: dict[FingerprintId, list[np.ndarray]] = defaultdict(list)
    for v in versions.iter_tokens(user, sid):  # SessionNotFound for anyone else
        if v.fingerprint is not None:
            drop[v.fingerprint].append(v.tokens)
    n_versions = versions.delete_session(user, sid)
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
            dropped += len(pages.drop(index.remove_paths(ns, drop[fid], keep[fid])))
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
