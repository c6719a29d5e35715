"""Start-up recovery: rebuild the in-memory index from the database and the disk tier.

Runs after a clean stop or a `kill -9`. The database rows and the page files are reconciled
(a row without its file, a file without its row, a page of a tenant whose key is gone, a row
whose sealed token ids do not open, a half written temp file: all removed), then every surviving
page becomes a disk-resident entry and the tries are rebuilt from the parent chains. Nothing here
trusts page bytes: they are verified against their checksum when they are loaded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from dss.errors import KeyDestroyed, WrongMasterKey
from dss.index.fingerprints import FingerprintRegistry
from dss.index.hashing import ROOT_PARENT
from dss.index.prefix_index import PrefixIndex
from dss.keys.keyring import Keyring
from dss.namespace import make_namespace
from dss.pages.meta import PageMeta
from dss.pages.placement import TieredPages
from dss.pages.tiers.disk import DiskTier
from dss.types import PageHash, TenantId

log = logging.getLogger("dss.ops.recovery")


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    pages_indexed: int
    temp_files_removed: int
    orphan_files_removed: int
    rows_without_file: int
    rows_unusable: int


def rebuild(
    disk: DiskTier | None,
    pages: TieredPages,
    index: PrefixIndex,
    fingerprints: FingerprintRegistry,
    keyring: Keyring,
) -> RecoveryReport:
    """Runs at open, before any other thread uses the store. The rows' token ids are sealed under
    their tenant's key (`dss.pages.rows`); the keyring is asked for the keys of the tenants that
    have one stored (`data_key` would create a missing one)."""
    temp_removed = disk.gc_temp() if disk is not None else 0
    files: dict[PageHash, int] = {}
    if disk is not None:
        for h, _header, size in disk.scan():
            files[h] = size

    keyed = keyring.tenants_with_keys()

    def key_of(tenant: TenantId) -> bytes | None:
        if tenant not in keyed:
            return None
        try:
            return keyring.data_key(tenant)
        except (KeyDestroyed, WrongMasterKey):  # erased, or a wrapped key that does not open
            return None

    rows, unusable = pages.rows.all(key_of)
    keep: dict[PageHash, PageMeta] = {}
    missing_file = 0
    for meta, _disk_bytes in rows:
        h = meta.hash
        if h not in files:
            missing_file += 1
            unusable.append(h)
        elif meta.fingerprint not in fingerprints:
            unusable.append(h)
        else:
            keep[h] = meta
    # Chains must reach the root through kept pages, or the pages can never be matched.
    reachable = _reachable(keep)
    unusable.extend(h for h in keep if h not in reachable)
    keep = {h: r for h, r in keep.items() if h in reachable}

    pages.rows.delete(unusable)
    orphans = [h for h in files if h not in keep]
    if disk is not None:
        for h in orphans:
            disk.delete(h)

    for h, meta in keep.items():
        pages.add_disk_resident(meta, files[h])
    _rebuild_index(index, fingerprints, pages, keep)
    report = RecoveryReport(len(keep), temp_removed, len(orphans), missing_file, len(unusable) - missing_file)
    if temp_removed or orphans or unusable:
        log.warning("recovery: %s", report)
    return report


def _reachable(rows: dict[PageHash, PageMeta]) -> set[PageHash]:
    ok: set[PageHash] = set()
    for h in rows:
        path: list[PageHash] = []
        cur = h
        while cur not in ok:
            row = rows.get(cur)
            if row is None:
                break
            path.append(cur)
            cur = row.parent
        if cur == ROOT_PARENT or cur in ok:
            ok.update(path)
    return ok


def _rebuild_index(
    index: PrefixIndex, fingerprints: FingerprintRegistry, pages: TieredPages, rows: dict[PageHash, PageMeta]
) -> None:
    """Insert, for each page that has no child in its own namespace, the whole path from the root
    into that namespace's trie. Public pages at the head of a private path are part of it."""
    has_same_ns_child: set[PageHash] = set()
    for meta in rows.values():
        p = rows.get(meta.parent)
        if p is not None and p.namespace == meta.namespace:
            has_same_ns_child.add(meta.parent)
    for leaf, leaf_meta in rows.items():
        if leaf in has_same_ns_child:
            continue
        path: list[PageHash] = []
        cur = leaf
        while cur != ROOT_PARENT:
            path.append(cur)
            cur = rows[cur].parent
        path.reverse()
        ns = make_namespace(leaf_meta.fingerprint, leaf_meta.tenant)
        tokens = np.concatenate([rows[h].tokens for h in path])
        # A tail page is a leaf whose metadata holds fewer than block_size tokens. Tails beyond
        # the per-page bound (a crash between an insert and its drop) go now.
        pushed_out = index.insert(ns, fingerprints.get(leaf_meta.fingerprint).block_size, tokens, path)
        if pushed_out:
            pages.copies.drop(pushed_out)
