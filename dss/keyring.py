"""Per-tenant data keys: created on first use, stored wrapped by the master key, destroyed on erase.

Destroying a tenant's key is what makes every copy of its encrypted pages unreadable, wherever
those copies are (crypto-shredding)."""

from __future__ import annotations

import threading

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from dss.crypto import KeyManager
from dss.db.models import DataKey
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
            with self._sf() as s, s.begin():
                row = s.execute(select(DataKey).where(DataKey.tenant == tenant)).scalar_one_or_none()
                if row is not None:
                    key = self._keys.unwrap(row.wrapped, tenant)
                else:
                    key = self._keys.new_data_key()
                    s.add(DataKey(tenant=tenant, wrapped=self._keys.wrap(key, tenant)))
            self._cache[tenant] = key
            return key

    def has_key(self, tenant: TenantId) -> bool:
        with self._sf() as s:
            return s.execute(select(DataKey.tenant).where(DataKey.tenant == tenant)).first() is not None

    def destroy_in(self, session: Session, tenant: TenantId) -> int:
        """Delete the wrapped key inside the caller's transaction; forget the cached copy."""
        n = session.execute(delete(DataKey).where(DataKey.tenant == tenant)).rowcount or 0
        with self._lock:
            self._cache.pop(tenant, None)
        return int(n)

    def forget_cached(self, tenant: TenantId) -> None:
        with self._lock:
            self._cache.pop(tenant, None)
