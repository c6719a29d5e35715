"""Deleting a session together with the cached KV pages only it used.

The session's rows go first (one transaction); then its private pages that none of the user's
other versions reach are dropped from every tier. Pages shared with another session of the
same user stay (they are that session's cache too), and public-prefix pages are never touched.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np

from api.state import AppState
from dss.types import FingerprintId
from dss.versions import MAX_LIST_LIMIT

log = logging.getLogger("dss.api.pages")


def drop_session_pages(state: AppState, user: str, sid: str) -> int:
    """Delete session `sid` of `user` and its exclusive pages; returns the pages dropped."""
    versions = state.store.versions
    doomed = versions.list_versions(user, sid, with_body=True)  # SessionNotFound for anyone else
    versions.delete_session(user, sid)
    drop: dict[FingerprintId, list[np.ndarray]] = defaultdict(list)
    for v in doomed:
        if v.fingerprint:
            drop[FingerprintId(v.fingerprint)].append(v.tokens)
    if not drop:
        return 0
    keep: dict[FingerprintId, list[np.ndarray]] = defaultdict(list)
    after: str | None = None
    while True:
        sessions, more = versions.list_sessions(user, limit=MAX_LIST_LIMIT, after=after)
        for s in sessions:
            for v in versions.list_versions(user, s.id, with_body=True):
                if v.fingerprint in drop:
                    keep[FingerprintId(v.fingerprint)].append(v.tokens)
        if not more or not sessions:
            break
        after = sessions[-1].id
    tenant = state.store.tenant_for(user)
    dropped = 0
    for fid, seqs in drop.items():
        if fid in state.store.fingerprints:
            dropped += state.store.drop_sequence_pages(fid, tenant, seqs, keep.get(fid, []))
    log.info("deleted a session with %d versions and %d cached pages", len(doomed), dropped)
    return dropped
