"""What a running server holds: settings, the store, the keys, the metrics and (maybe) the engine."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlalchemy import func, select

from api.auth import ApiKeys
from api.metrics import Metrics
from api.settings import Settings
from dss.db.engine import transaction
from dss.db.models import ErasureReceiptRow
from dss.store import Store
from dss.types import TenantId

if TYPE_CHECKING:
    from api.engine import ChatEngine


class SaltBook:
    """The engine's prefix-cache salt of each tenant: the tenant plus its erasure count.

    vLLM's own prefix cache keeps blocks of an erased user until they age out; a user re-created
    under the same id gets the same tenant, so the salt must change with each erasure for the
    re-created user to start cold (`cached_tokens == 0`) without flushing everybody's cache.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._epochs: dict[TenantId, int] = {}

    def salt(self, user: str, tenant: TenantId) -> str:
        with self._lock:
            epoch = self._epochs.get(tenant)
        if epoch is None:
            # Receipts name their subject by a salted hash; accept either form the store writes.
            subjects = {tenant, self._store.subject_hash(user)}
            with transaction(self._store.sf) as db:
                epoch = (
                    db.scalar(
                        select(func.count())
                        .select_from(ErasureReceiptRow)
                        .where(ErasureReceiptRow.subject.in_(subjects))
                    )
                    or 0
                )
            with self._lock:
                epoch = self._epochs.setdefault(tenant, epoch)
        return f"{tenant}.{epoch}"

    def bump(self, tenant: TenantId) -> None:
        """Called after an erasure commits."""
        with self._lock:
            self._epochs.pop(tenant, None)


@dataclass
class AppState:
    settings: Settings
    store: Store
    keys: ApiKeys
    metrics: Metrics
    salts: SaltBook
    engine: ChatEngine | None = None
    started: bool = field(default=False)

    @property
    def dev_mode(self) -> bool:
        """No active API key and a loopback bind: identities come from the request."""
        return (
            self.settings.auth.allow_dev_mode
            and self.settings.server.is_loopback
            and not self.keys.any_active()
        )
