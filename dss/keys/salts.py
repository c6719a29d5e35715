"""The engine's prefix-cache salt of each tenant: the tenant plus its erasure count.

vLLM's own prefix cache keeps blocks of an erased user until they age out; a user re-created
under the same id gets the same tenant, so the salt must change with each erasure for the
re-created user to start cold (`cached_tokens == 0`) without flushing everybody's cache.

Lock: `SaltBook._lock` is a leaf around the cache; the count is read from the database outside it.
A generation number, bumped by every erasure, keeps a count read before an erasure from being
cached after it.
"""

from __future__ import annotations

import threading

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from dss.db.models import ErasureReceiptRow
from dss.types import TenantId


class SaltBook:
    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._sf = session_factory
        self._lock = threading.Lock()
        self._epochs: dict[TenantId, int] = {}
        self._generation: dict[TenantId, int] = {}

    def salt(self, tenant: TenantId, subject: str | None = None) -> str:
        """`subject`: the user's receipt subject hash, when receipts may name it instead."""
        with self._lock:
            epoch = self._epochs.get(tenant)
            generation = self._generation.get(tenant, 0)
        if epoch is None:
            subjects = {tenant} if subject is None else {tenant, subject}
            with self._sf() as s:
                epoch = int(
                    s.scalar(
                        select(func.count())
                        .select_from(ErasureReceiptRow)
                        .where(ErasureReceiptRow.subject.in_(subjects))
                    )
                    or 0
                )
            with self._lock:
                if self._generation.get(tenant, 0) == generation:
                    self._epochs[tenant] = epoch
        return f"{tenant}.{epoch}"

    def bump(self, tenant: TenantId) -> None:
        """Called after an erasure commits."""
        with self._lock:
            self._epochs.pop(tenant, None)
            self._generation[tenant] = self._generation.get(tenant, 0) + 1
