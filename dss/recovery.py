"""Start-up recovery: rebuild the in-memory index from the database and the disk tier.

Runs after a clean stop or a `kill -9`. The database rows and the page files are reconciled
(a row without its file, a file without its row, a page of a tenant whose key is gone, a half
written temp file: all removed), then every surviving page becomes a disk-resident entry and the
tries are rebuilt from the parent chains. Nothing here trusts page bytes: they are verified
against their checksum when they are loaded.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from sqlalchemy import delete, select

from dss.db.models import DataKey, PageRow
from dss.hashing import ROOT_PARENT
from dss.pages import PageMeta
from dss.types import FingerprintId, NamespaceId, PageHash, TenantId

if TYPE_CHECKING:
    from dss.store import Store

log = logging.getLogger("dss.recovery")


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    pages_indexed: int
    temp_files_removed: int
    orphan_files_removed: int
    rows_without_file: int
    rows_unusable: int


def rebuild(store: Store) -> RecoveryReport:
    disk = store.disk
    temp_removed = disk.gc_temp() if disk is not None else 0
    files: dict[PageHash, int] = {}
    if disk is not None:
        for h, _header, size in disk.scan():
            files[h] = size

    with store.sf() as s:
        rows = list(s.execute(select(PageRow)).scalars())
        keyed = set(s.execute(select(DataKey.tenant)).scalars())

    keep: dict[PageHash, PageRow] = {}
    unusable: list[PageHash] = []
    missing_file = 0
    for row in rows:
        h = PageHash(bytes(row.hash))
        if h not in files:
            missing_file += 1
            unusable.append(h)
        elif row.tenant not in keyed or row.fingerprint not in store.fingerprints:
            unusable.append(h)
        else:
            keep[h] = row
    # Chains must reach the root through kept pages, or the pages can never be matched.
    reachable = _reachable(keep)
    unusable.extend(h for h in keep if h not in reachable)
    keep = {h: r for h, r in keep.items() if h in reachable}

    if unusable:
        with store.sf() as s, s.begin():
            for i in range(0, len(unusable), 500):
                s.execute(delete(PageRow).where(PageRow.hash.in_(unusable[i : i + 500])))
    orphans = [h for h in files if h not in keep]
    if disk is not None:
        for h in orphans:
            disk.delete(h)

    for h, row in keep.items():
        meta = PageMeta(
            hash=h,
            namespace=NamespaceId(bytes(row.namespace)),
            tenant=TenantId(row.tenant),
            fingerprint=FingerprintId(row.fingerprint),
            parent=PageHash(bytes(row.parent)),
            index=row.page_index,
            nbytes=row.nbytes,
            tokens=np.frombuffer(row.tokens, dtype="<i4").copy(),
            checksum=bytes(row.checksum or b""),
        )
        store.pages.add_disk_resident(meta, files[h])
    _rebuild_tries(store, keep)
    report = RecoveryReport(len(keep), temp_removed, len(orphans), missing_file, len(unusable) - missing_file)
    if temp_removed or orphans or unusable:
        log.warning("recovery: %s", report)
    return report


def _reachable(rows: dict[PageHash, PageRow]) -> set[PageHash]:
    ok: set[PageHash] = set()
    for h in rows:
        path: list[PageHash] = []
        cur = h
        while cur not in ok:
            row = rows.get(cur)
            if row is None:
                break
            path.append(cur)
            cur = PageHash(bytes(row.parent))
        if cur == ROOT_PARENT or cur in ok:
            ok.update(path)
    return ok


def _rebuild_tries(store: Store, rows: dict[PageHash, PageRow]) -> None:
    """Insert, for each page that has no child in its own namespace, the whole path from the root
    into that namespace's trie. Public pages at the head of a private path are part of it."""
    has_same_ns_child: set[PageHash] = set()
    for row in rows.values():
        parent = PageHash(bytes(row.parent))
        p = rows.get(parent)
        if p is not None and bytes(p.namespace) == bytes(row.namespace):
            has_same_ns_child.add(parent)
    by_ns: dict[NamespaceId, list[PageHash]] = defaultdict(list)
    for h, row in rows.items():
        if h not in has_same_ns_child:
            by_ns[NamespaceId(bytes(row.namespace))].append(h)
    for _ns_id, leaves in by_ns.items():
        for leaf in leaves:
            path: list[PageHash] = []
            cur = leaf
            while cur != ROOT_PARENT:
                path.append(cur)
                cur = PageHash(bytes(rows[cur].parent))
            path.reverse()
            leaf_row = rows[leaf]
            ns = store.namespace(FingerprintId(leaf_row.fingerprint), TenantId(leaf_row.tenant))
            trie = store._trie(ns, create=True)
            assert trie is not None
            tokens = np.concatenate([np.frombuffer(rows[h].tokens, dtype="<i4") for h in path])
            trie.insert(tokens, path)
