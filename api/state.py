"""What a running server holds: settings, the store, the keys, the metrics and (maybe) the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from api.auth import ApiKeys
from api.metrics import Metrics
from api.settings import Settings
from dss.store import Store

if TYPE_CHECKING:
    from api.engine import ChatEngine


@dataclass
class AppState:
    settings: Settings
    store: Store
    keys: ApiKeys
    metrics: Metrics
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
