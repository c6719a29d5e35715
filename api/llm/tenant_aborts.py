"""The generations running per tenant, so that erasing a user stops theirs.

An aborted generation ends with `ErasedDuringGeneration` (`api.llm.generation`), so no version of
it is committed. One event loop runs every generation: no lock is needed.
"""

from __future__ import annotations

from typing import Any

from dss.types import TenantId


class TenantAborts:
    def __init__(self) -> None:
        self._running: dict[TenantId, set[str]] = {}
        self._aborted: set[str] = set()

    def begin(self, tenant: TenantId, request_id: str) -> None:
        self._running.setdefault(tenant, set()).add(request_id)

    def was_aborted(self, request_id: str) -> bool:
        return request_id in self._aborted

    def end(self, tenant: TenantId, request_id: str) -> bool:
        """Forget the generation, however it ended (no id is kept); whether it was aborted."""
        running = self._running.get(tenant)
        if running is not None:
            running.discard(request_id)
            if not running:
                del self._running[tenant]
        aborted = request_id in self._aborted
        self._aborted.discard(request_id)
        return aborted

    async def abort_tenant(self, llm: Any, tenant: TenantId) -> int:
        """Stop every generation of `tenant` in vLLM (`llm`); how many."""
        ids = list(self._running.get(tenant, ()))
        if ids:
            self._aborted.update(ids)
            await llm.abort(ids)
        return len(ids)
