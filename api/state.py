"""What a running server holds: settings, the store, the keys, the metrics and (maybe) the engine;
and, while it starts, how far it got (`Startup`)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from api.keys.api_keys import ApiKeys
from api.metrics import Metrics
from api.ratelimit import TokenBuckets
from api.settings import Settings
from dss.db.write_gate import without_waiting, would_wait
from dss.dialogue.lead.gate import QualityGate
from dss.store import Store
from dss.types import TenantId

if TYPE_CHECKING:
    from api.llm.chat_engine import ChatEngine

P = ParamSpec("P")
T = TypeVar("T")

# Threads for short metadata operations (rollback, branch): a few, so that they neither queue
# behind long thread-pool work (rendering, tokenizing, erasure) nor add many more writers to
# contend for SQLite's write lock, whose busy handler sleeps 1, 2, 5, 10... ms between tries.
SHORT_DB_THREADS = 2
# How long a short write waits on the event loop for the write gate kept for it
# (`AppState.short_db_op`) before it goes to the short-operation threads (where it waits at the
# gate again, first in line): a writer inside SQLite's lock that long is stuck, not busy.
RESERVATION_WAIT_S = 2.0


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():  # its waiter may have gone (a client that hung up)
        future.set_result(None)


def _short_db_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=SHORT_DB_THREADS, thread_name_prefix="dss-short-db")


class Phase(enum.Enum):
    """Where a server's start-up is; the value is the reason `/readyz` gives while not ready."""

    STORE_OPENING = "store opening"
    ENGINE_STARTING = "engine starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "shutting down"


@dataclass
class Startup:
    """The server listens before the store is open and the engine runs (a CPU engine takes a
    minute to load): this is what `/readyz` and the 503s of the other routes report meanwhile."""

    phase: Phase = Phase.STORE_OPENING
    error: str | None = None  # one line, when the phase is FAILED
    exit_code: int = 0  # what `dss serve` exits with after a failed start (2: refused, 1: failed)

    @property
    def reason(self) -> str:
        if self.phase is Phase.FAILED:
            return f"start-up failed: {self.error}"
        return str(self.phase.value)


class TenantAborter:
    """The store's `on_tenant_erased` hook: another server of the fleet erased a user, so this
    server stops that tenant's running generations (as `DELETE /v1/users/{id}` does on the erasing
    server) before its copies are dropped. Called on the store's follower thread; the engine lives
    on the event loop, so the abort is handed to the loop and waited for (bounded)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float = 10.0) -> None:
        self._loop = loop
        self._timeout_s = timeout_s
        self.engine: ChatEngine | None = None  # set once the engine runs

    def __call__(self, tenant: TenantId) -> None:
        engine = self.engine
        if engine is None or self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(engine.abort_tenant(tenant), self._loop).result(self._timeout_s)


@dataclass
class AppState:
    settings: Settings
    store: Store
    keys: ApiKeys
    metrics: Metrics
    engine: ChatEngine | None = None
    started: bool = field(default=False)
    short_db: ThreadPoolExecutor = field(default_factory=_short_db_pool)
    # Per-user buckets for erasure checks (`api.routes.users`), sized by the limits table.
    erasure_checks: TokenBuckets = field(init=False)
    # Per-key buckets for erasures (`api.routes.users`): a frontend key erases for many end users.
    erasures_per_key: TokenBuckets = field(init=False)
    # The quality gate of lead updates (`dss.dialogue.lead.gate`), per frontend, in memory.
    lead_gate: QualityGate = field(init=False)

    def __post_init__(self) -> None:
        limits = self.settings.limits
        self.erasure_checks = TokenBuckets(limits.erasure_checks_per_minute, limits.erasure_checks_burst)
        self.erasures_per_key = TokenBuckets(
            limits.erasures_per_key_per_minute, limits.erasures_per_key_burst
        )
        lead = self.settings.lead
        self.lead_gate = QualityGate(
            lead.gate_window, lead.gate_min_checks, lead.gate_min_agreement, lead.gate_max_distance
        )

    async def short_db_op(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)`, a short metadata write a client waits for (a rollback, a new
        branch): on the event loop itself where it waits for nothing there, else on the
        short-operation threads.

        Under load a write on a thread waited for the GIL at each of its SQLite calls, behind
        the loop and the other threads of the process (rollback p99 52-69 ms in
        `bench/api_load.py`, issue 31); on the loop it runs its 2-3 ms in one piece. On a SQLite
        file the loop first has the write gate kept for it (`WriteGate.reserve`): while another
        writer of this process is inside SQLite's lock (a turn's commit, the disk writer's page
        rows) the loop serves others, and the writer leaving wakes it. The write then runs inside
        `without_waiting()`: should it still meet a writer (another process's, SQLite's busy
        handler then gives up at once), its transaction is rolled back, nothing of it written,
        and it runs again on a thread, where waiting is fine; its commit leaves the WAL's
        checkpoint to the next writer. PostgreSQL (row locks no gate knows), or every pooled
        connection held: a thread at once."""
        call = functools.partial(fn, *args, **kwargs)
        loop = asyncio.get_running_loop()
        gate = self.store.write_gate
        if gate is not None and self.store.db_checkout_free():
            kept = loop.create_future()

            def wake() -> None:  # on the thread leaving the gate
                loop.call_soon_threadsafe(_settle, kept)

            try:
                in_time = gate.reserve(wake)
                if not in_time:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(kept, RESERVATION_WAIT_S)
                        in_time = True
                if in_time:
                    try:
                        with without_waiting():
                            result = call()
                    except Exception as exc:
                        if not would_wait(exc):
                            raise
                    else:
                        self.metrics.short_writes.labels("loop").inc()
                        return result
            finally:
                gate.unreserve(wake)
        self.metrics.short_writes.labels("thread").inc()
        return await loop.run_in_executor(self.short_db, call)

    @property
    def dev_mode(self) -> bool:
        """Asked for with `dss serve --dev` (loopback only, checked before the server starts)."""
        return self.settings.auth.dev_mode
