"""`TenantGate`: which tenants may save now, and how many of their saves are in flight.

A save (a plan, a commit, an adoption of remote pages) runs inside `saving(tenant)`; an erasure
inside `erasing(tenant)`. While an erasure of the tenant runs, or once the tenant is retired (erased
for good), `saving` yields False and counts nothing; `wait_quiet` returns once the saves that were
already in flight have finished. Together: nothing of the tenant is published behind an
erasure's back.

Lock: `TenantGate._lock` (+ the condition `_quiet`, notified when a save finishes) is a leaf
around the two counters. `is_retired` is asked before it is taken.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from dss.errors import StorageError
from dss.types import TenantId


class TenantGate:
    def __init__(self, is_retired: Callable[[TenantId], bool] = lambda _tenant: False) -> None:
        self._is_retired = is_retired  # a tenant erased for good (`Keyring.is_retired`)
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)
        self._erasing: dict[TenantId, int] = {}  # erasures of each tenant running now
        self._active: dict[TenantId, int] = {}  # saves of each tenant being published now

    def is_retired(self, tenant: TenantId) -> bool:
        return self._is_retired(tenant)

    @contextlib.contextmanager
    def saving(self, tenant: TenantId) -> Iterator[bool]:
        """Count a save of `tenant` as in flight; yields False (and counts nothing) while the
        tenant is being erased or after it was."""
        retired = self._is_retired(tenant)  # asked before our lock: locks are never nested
        with self._lock:
            allowed = not retired and tenant not in self._erasing
            if allowed:
                self._active[tenant] = self._active.get(tenant, 0) + 1
        try:
            yield allowed
        finally:
            if allowed:
                with self._lock:
                    self._active[tenant] -= 1
                    if not self._active[tenant]:
                        del self._active[tenant]
                    self._quiet.notify_all()

    @contextlib.contextmanager
    def erasing(self, tenant: TenantId) -> Iterator[None]:
        """Refuse the tenant's saves (`saving` yields False) until the block ends."""
        with self._lock:
            self._erasing[tenant] = self._erasing.get(tenant, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._erasing[tenant] -= 1
                if not self._erasing[tenant]:
                    del self._erasing[tenant]

    def wait_quiet(self, tenant: TenantId, deadline: float) -> None:
        """Wait until no save of `tenant` is in flight; `StorageError` at `deadline` (monotonic)."""
        with self._lock:
            while self._active.get(tenant):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageError("saves of the user did not finish in time; erase again")
                self._quiet.wait(left)
