"""Deleting a session together with the cached KV pages only it used.

The session's rows go first (one transaction); then its private pages that none of the user's
other versions reach are cut from the index and dropped from every tier. Pages shared with
another session of the same user stay (they are that session's cache too), and public-prefix
pages are never touched.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np

from dss.dialogue.versions import MAX_LIST_LIMIT, VersionStore
from dss.index.fingerprints import FingerprintRegistry
from dss.index.hashing import as_tokens
from dss.index.prefix_index import PrefixIndex
from dss.keys.identity import Identity
from dss.namespace import make_namespace
from dss.pages.manager import TieredPages
from dss.types import FingerprintId

log = logging.getLogger("dss.sessions")


def delete_session(
    versions: VersionStore,
    identity: Identity,
    fingerprints: FingerprintRegistry,
    index: PrefixIndex,
    pages: TieredPages,
    user: str,
    sid: str,
) -> int:
    """Delete session `sid` of `user` and its exclusive pages; returns the pages dropped."""
    doomed = versions.list_versions(user, sid, with_body=True)  # SessionNotFound for anyone else
    versions.delete_session(user, sid)
    drop: dict[FingerprintId, list[np.ndarray]] = defaultdict(list)
    for v in doomed:
        if v.fingerprint:
            drop[FingerprintId(v.fingerprint)].append(as_tokens(v.tokens))
    if not drop:
        return 0
    keep: dict[FingerprintId, list[np.ndarray]] = defaultdict(list)
    after: str | None = None
    while True:
        sessions, more = versions.list_sessions(user, limit=MAX_LIST_LIMIT, after=after)
        for s in sessions:
            for v in versions.list_versions(user, s.id, with_body=True):
                if v.fingerprint in drop:
                    keep[FingerprintId(v.fingerprint)].append(as_tokens(v.tokens))
        if not more or not sessions:
            break
        after = sessions[-1].id
    tenant = identity.tenant_for(user)
    dropped = 0
    for fid, seqs in drop.items():
        if fid in fingerprints:
            cut = index.remove_paths(make_namespace(fid, tenant), seqs, keep.get(fid, []))
            dropped += len(pages.drop(cut))
    log.info("deleted a session with %d versions and %d cached pages", len(doomed), dropped)
    return dropped
