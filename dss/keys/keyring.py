"""Per-tenant data keys: created on first use, stored wrapped by the master key, destroyed on erase.

Destroying a tenant's key is what makes every copy of its encrypted pages unreadable, wherever
those copies are (crypto-shredding).

A tenant retired by an erasure (its user moved to the next erasure epoch) never gets a key
again: `data_key` raises `KeyDestroyed` for it, so nothing of it can be written or read after the
erasure, whatever was still in flight. Retired tenants are the subjects of receipts that moved an
epoch (older receipts did not).

Lock: `Keyring._lock` is a leaf around the in-memory cache of unwrapped keys and the retired set.
The database is read and written outside it; two threads creating the first key of one tenant at
once race on the table's primary key, and the loser reads the winner's key. A new key is
inserted in the transaction that checks the master-key verifier (`check_master_in`): a server
whose master was rotated under it refuses (`MasterKeyRotated`) rather than wrap under the old one.

The cache of unwrapped keys holds at most `cache_entries` tenants (`StoreConfig.data_key_cache_entries`:
tenants follow user ids, which frontends choose): the least recently used is dropped, in memory
only, and unwrapped again from its row when it is next needed. The retired set is not a cache:
it is what refuses an erased tenant a new key, and grows with erasures, not with requests.
"""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any, cast

from sqlalchemy import CursorResult, delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from dss.config import DEFAULT_CACHE_ENTRIES
from dss.db import receipt_rows
from dss.db.connect import transaction
from dss.db.models import DataKey
from dss.errors import KeyDestroyed
from dss.keys.bounded import BoundedLru
from dss.keys.crypto import KeyManager
from dss.keys.identity import check_master_in
from dss.types import TenantId


class Keyring:
    def __init__(
        self,
        keys: KeyManager,
        session_factory: sessionmaker[Session],
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
    ) -> None:
        self._keys = keys
        self._sf = session_factory
        self._cache: BoundedLru[TenantId, bytes] = BoundedLru(cache_entries)
        self._lock = threading.Lock()
        with session_factory() as s:
            self._retired: set[TenantId] = {TenantId(sub) for sub in receipt_rows.retired_subjects_in(s)}

    def is_retired(self, tenant: TenantId) -> bool:
        with self._lock:
            return tenant in self._retired

    def retire(self, tenant: TenantId) -> None:
        """After an erasure commits: the tenant never gets a data key again."""
        with self._lock:
            self._retired.add(tenant)
            self._cache.pop(tenant)

    def unretire(self, tenant: TenantId) -> None:
        """An erasure that retired `tenant` failed before it committed."""
        with self._lock:
            self._retired.discard(tenant)

    def data_key(self, tenant: TenantId) -> bytes:
        with self._lock:
            if tenant in self._retired:
                raise KeyDestroyed(f"tenant {tenant} was erased; its data key is gone")
            key = self._cache.get(tenant)
        if key is not None:
            return key
        for _ in range(2):
            with self._sf() as s:
                row = s.execute(select(DataKey).where(DataKey.tenant == tenant)).scalar_one_or_none()
                wrapped = row.wrapped if row is not None else None
            if wrapped is not None:
                key = self._keys.unwrap(wrapped, tenant)
                break
            key = self._keys.new_data_key()
            try:
                with transaction(self._sf) as s:
                    # A rotation since this server read its master: refuse (`MasterKeyRotated`).
                    check_master_in(s, self._keys)
                    s.add(DataKey(tenant=tenant, wrapped=self._keys.wrap(key, tenant)))
                break
            except IntegrityError:
                continue  # created meanwhile by another thread: read it
        assert key is not None
        with self._lock:
            if tenant in self._retired:  # erased while we read or created it
                raise KeyDestroyed(f"tenant {tenant} was erased; its data key is gone")
            held = self._cache.get(tenant)
            if held is not None:
                return held
            self._cache.put(tenant, key)
            return key

    def holds_key(self, tenant: TenantId) -> bool:
        """Whether `tenant` has a data key (it wrote KV once, and was not erased since)."""
        with self._lock:
            if tenant in self._cache:
                return True
        with self._sf() as s:
            return s.scalar(select(DataKey.tenant).where(DataKey.tenant == tenant)) is not None

    def key_created_by(self, tenant: TenantId, cutoff: datetime) -> bool:
        """Whether `tenant` has a data key created by `cutoff` (an erasure's verification)."""
        with self._sf() as s:
            q = select(DataKey.tenant).where(DataKey.tenant == tenant, DataKey.created_at <= cutoff)
            return s.scalar(q) is not None

    def tenants_with_keys(self) -> set[TenantId]:
        """Every tenant with a stored data key (recovery asks `data_key` only for those: it would
        create a missing one)."""
        with self._sf() as s:
            return {TenantId(t) for t in s.execute(select(DataKey.tenant)).scalars()}

    def destroy_in(self, db: Session, tenant: TenantId) -> int:
        """Delete the wrapped key inside the caller's transaction; forget the cached copy."""
        n = cast(CursorResult[Any], db.execute(delete(DataKey).where(DataKey.tenant == tenant))).rowcount
        self.forget_cached(tenant)
        return int(n)

    def forget_cached(self, tenant: TenantId) -> None:
        with self._lock:
            self._cache.pop(tenant)

    def cached_keys(self) -> int:
        """How many unwrapped data keys are cached now (at most `cache_entries`)."""
        with self._lock:
            return len(self._cache)


def rewrap_data_keys_in(s: Session, old: KeyManager, new: KeyManager) -> int:
    """In the caller's transaction (a master-key rotation): every data key, its row locked,
    unwrapped under `old` and wrapped under `new`; returns how many."""
    n = 0
    for row in s.execute(select(DataKey).with_for_update()).scalars():
        row.wrapped = new.wrap(old.unwrap(bytes(row.wrapped), row.tenant), row.tenant)
        n += 1
    return n


def delete_all_but_in(s: Session, kept: TenantId) -> int:
    """In the caller's transaction: every data key but `kept`'s (the tenant-derivation upgrade
    keeps the public tenant's); returns how many."""
    done = s.execute(delete(DataKey).where(DataKey.tenant != kept))
    return int(cast(CursorResult[Any], done).rowcount)
