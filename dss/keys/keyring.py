"""Per-tenant data keys: created on first use, stored wrapped by the master key, destroyed on erase.

Destroying a tenant's key is what makes every copy of its encrypted pages unreadable, wherever
those copies are (crypto-shredding).

Lock: `Keyring._lock` is a leaf around the in-memory cache of unwrapped keys. The database is
read and written outside it; two threads creating the first key of one tenant at once race on the
table's primary key, and the loser reads the winner's key.
"""

from __future__ import annotations

import threading

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from dss.db.engine import transaction
from dss.db.models import DataKey
from dss.keys.crypto import KeyManager
from dss.types import TenantId


class Keyring:
    def __init__(self, keys: KeyManager, session_factory: sessionmaker[Session]) -> None:
        self._keys = keys
        self._sf = session_factory
        self._cache: dict[TenantId, bytes] = {}
        self._lock = threading.Lock()

    def data_key(self, tenant: TenantId) -> bytes:
        with self._lock:
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
                    s.add(DataKey(tenant=tenant, wrapped=self._keys.wrap(key, tenant)))
                break
            except IntegrityError:
                continue  # created meanwhile by another thread: read it
        assert key is not None
        with self._lock:
            return self._cache.setdefault(tenant, key)

    def destroy_in(self, session: Session, tenant: TenantId) -> int:
        """Delete the wrapped key inside the caller's transaction; forget the cached copy."""
        n = session.execute(delete(DataKey).where(DataKey.tenant == tenant)).rowcount or 0
        self.forget_cached(tenant)
        return int(n)

    def forget_cached(self, tenant: TenantId) -> None:
        with self._lock:
            self._cache.pop(tenant, None)
