"""How the servers of a fleet learn of erasures, apply them, and acknowledge them.

The server that erases a user (A) commits, in one transaction, the shared part (rows, the data
key, the hash-chained receipt), a pending acknowledgement row for every other server alive at
that moment, its own acknowledgement, and a `NOTIFY dss_erasure` carrying the receipt id
(PostgreSQL delivers it at commit, to every listening connection, or to none if it rolls back).

Every server runs an `ErasureFollower`: a daemon thread that `LISTEN`s on its own autocommit
connection and, on every notification, every `poll_s` and right after every (re)connect, catches
up: it applies each receipt with a seq above its `servers.erasure_seq`, in seq order, writes its
acknowledgement (what it dropped, what its local scan still found) and advances `erasure_seq`,
in one transaction. Notifications only make it prompt; the catch-up makes it complete: a missed
notification, a dropped connection or a server that was down loses nothing. Applying is
idempotent (a receipt already acknowledged by this server is skipped; applying one twice finds
nothing left to drop), so a crash between applying and acknowledging only repeats the work.

After its commit, A waits (bounded, `ack_timeout_s`) for the pending acknowledgements, and the
receipt's `fleet` section lists every server's counts and the servers that did not answer.

No lock here: the follower thread is the only one that applies receipts, and each database call
is its own short transaction. The apply callback runs on the follower thread, with no lock held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy import func, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from dss.db import receipt_rows
from dss.db.connect import transaction
from dss.db.models import ErasureAckRow, ServerRow
from dss.types import TenantId

log = logging.getLogger("dss.fleet")

CHANNEL = "dss_erasure"
_WAKE_S = 0.5  # the listener looks at its stop event at least this often
_ACK_POLL_S = 0.02


@dataclass(frozen=True, slots=True)
class LocalErasure:
    """What one server dropped of a tenant (`counts`: pages and bytes per tier, remote keys) and
    how many copies its own scan still found afterwards (0: none)."""

    counts: dict[str, Any]
    remnants: int


@dataclass(frozen=True, slots=True)
class FleetReport:
    """The fleet section of a receipt: each acknowledging server's counts (the erasing server's
    own included) and the servers alive at the erasure that have not acknowledged it."""

    servers: dict[str, dict[str, Any]]
    unanswered: tuple[str, ...]
    remnants: dict[str, int] = field(default_factory=dict)  # servers whose own scan found copies


# ------------------------------------------------------------------------------ the erasing side
def record_erasure_in(
    db: Session, receipt_id: str, server_id: str, alive: list[str], own: dict[str, Any]
) -> None:
    """In the erasure's transaction: the erasing server's acknowledgement, a pending one for every
    other server alive now, and the notification (delivered when the transaction commits)."""
    db.add(
        ErasureAckRow(receipt_id=receipt_id, server=server_id, acked_at=func.now(), counts=own, remnants=0)
    )
    for other in alive:
        if other != server_id:
            db.add(ErasureAckRow(receipt_id=receipt_id, server=other))
    db.flush()
    db.execute(text("SELECT pg_notify(:channel, :rid)"), {"channel": CHANNEL, "rid": receipt_id})


def update_own_counts(
    sf: sessionmaker[Session], receipt_id: str, server_id: str, counts: dict[str, Any]
) -> None:
    """After the commit: the erasing server's counts with what only the irreversible steps know
    (the remote tier's keys)."""
    with transaction(sf) as s:
        s.execute(
            update(ErasureAckRow)
            .where(ErasureAckRow.receipt_id == receipt_id, ErasureAckRow.server == server_id)
            .values(counts=counts)
        )


def fleet_report(sf: sessionmaker[Session], receipt_id: str) -> FleetReport | None:
    """The receipt's fleet section from `erasure_acks` (None: no server acknowledged it, as for
    receipts of a single server on SQLite, or written before fleets)."""
    with sf() as s:
        rows = list(s.execute(select(ErasureAckRow).where(ErasureAckRow.receipt_id == receipt_id)).scalars())
    if not rows:
        return None
    done = sorted((r for r in rows if r.acked_at is not None), key=lambda r: r.server)
    return FleetReport(
        servers={r.server: dict(r.counts or {}) for r in done},
        unanswered=tuple(sorted(r.server for r in rows if r.acked_at is None)),
        remnants={r.server: int(r.remnants) for r in done if r.remnants},
    )


def wait_for_acks(sf: sessionmaker[Session], receipt_id: str, timeout_s: float) -> FleetReport | None:
    """Until every pending acknowledgement of the receipt is in, or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = fleet_report(sf, receipt_id)
        if report is None or not report.unanswered or time.monotonic() >= deadline:
            return report
        time.sleep(_ACK_POLL_S)


# ------------------------------------------------------------------------------ the other servers
@dataclass(frozen=True, slots=True)
class PendingReceipt:
    id: str
    seq: int
    tenant: TenantId
    retires: bool  # the receipt moved its user's epoch: the tenant is retired for good


ApplyErasure = Callable[[PendingReceipt], LocalErasure]


class ErasureFollower:
    """The thread that keeps this server's copies in step with the fleet's erasure receipts."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        db_url: str,
        server_id: str,
        apply: ApplyErasure,
        poll_s: float = 3.0,
        reconnect_max_s: float = 5.0,
        also_catch_up: Callable[[], int] | None = None,
    ) -> None:
        """`also_catch_up`: run after every erasure catch-up on the same thread (the fleet's page
        drops, `dss.fleet.page_drops`), its failures logged and retried like the erasures'."""
        self._sf = session_factory
        self._dsn = _libpq_dsn(db_url)
        self.server_id = server_id
        self._apply = apply
        self._also_catch_up = also_catch_up
        self._poll_s = poll_s
        self._reconnect_max_s = reconnect_max_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Written by the follower thread only; read by tests and stats (ints: no torn reads).
        self.connects = 0
        self.applied = 0
        self.errors = 0

    @property
    def application_name(self) -> str:
        """How the listening connection shows in `pg_stat_activity`."""
        return f"dss-erasures-{self.server_id}"[:63]

    def stopping(self) -> bool:
        """Whether `close` was called (a long catch-up stops between rows)."""
        return self._stop.is_set()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dss-fleet-erasures", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None

    def catch_up(self) -> int:
        """Apply and acknowledge every receipt after this server's `erasure_seq`, in seq order;
        returns how many were applied. Called by the follower thread (and by tests)."""
        with self._sf() as s:
            row = s.get(ServerRow, self.server_id)
            after = int(row.erasure_seq) if row is not None else 0
            pending = receipt_rows.after_in(s, after)
            acked = set(
                s.execute(
                    select(ErasureAckRow.receipt_id).where(
                        ErasureAckRow.server == self.server_id,
                        ErasureAckRow.acked_at.is_not(None),
                        ErasureAckRow.receipt_id.in_([r.id for r in pending]),
                    )
                ).scalars()
            )
        applied = 0
        for record in pending:
            if self._stop.is_set():
                break
            if record.id in acked:  # this server wrote it (it erased the user) or acknowledged it before
                self._advance(record.seq)
                continue
            retires = "epoch" in (record.counts or {})
            receipt = PendingReceipt(record.id, record.seq, TenantId(record.subject), retires)
            local = self._apply(receipt)
            self._acknowledge(receipt, local)
            applied += 1
        self.applied += applied
        return applied

    def _advance(self, seq: int) -> None:
        with transaction(self._sf) as s:
            s.execute(
                update(ServerRow)
                .where(ServerRow.id == self.server_id, ServerRow.erasure_seq < seq)
                .values(erasure_seq=seq)
            )

    def _acknowledge(self, receipt: PendingReceipt, local: LocalErasure) -> None:
        with transaction(self._sf) as s:
            ack = s.get(ErasureAckRow, (receipt.id, self.server_id), with_for_update=True)
            if ack is None:  # not alive when it was erased (down, or new): acknowledge anyway
                ack = ErasureAckRow(receipt_id=receipt.id, server=self.server_id)
                s.add(ack)
            ack.acked_at = func.now()
            ack.counts = local.counts
            ack.remnants = local.remnants
            s.execute(
                update(ServerRow)
                .where(ServerRow.id == self.server_id, ServerRow.erasure_seq < receipt.seq)
                .values(erasure_seq=receipt.seq)
            )
        log.info(
            "erasure %s applied here (%s): %s, %d remnant(s)",
            receipt.id,
            self.server_id,
            local.counts,
            local.remnants,
        )

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                with psycopg.connect(
                    self._dsn, autocommit=True, connect_timeout=3, application_name=self.application_name
                ) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.connects += 1
                    backoff = 0.1
                    self._listen(conn)
            except Exception as exc:  # whatever it is, the follower must not end: back off, retry
                self.errors += 1
                log.warning(
                    "fleet erasure listener of %s: %s; reconnecting in %.1fs", self.server_id, exc, backoff
                )
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self._reconnect_max_s)

    def _listen(self, conn: psycopg.Connection[Any]) -> None:
        """Catch up now (anything sent while we were not listening), then on every notification
        and every `poll_s`. Returns when stopped; raises when the connection drops."""
        self._catch_up_logged()
        next_poll = time.monotonic() + self._poll_s
        while not self._stop.is_set():
            woke = False
            for _notify in conn.notifies(timeout=_WAKE_S, stop_after=1):
                woke = True
            if woke or time.monotonic() >= next_poll:
                self._catch_up_logged()
                next_poll = time.monotonic() + self._poll_s

    def _catch_up_logged(self) -> None:
        for what, step in (("erasure", self.catch_up), ("page drop", self._also_catch_up)):
            if step is None:
                continue
            try:
                step()
            except SQLAlchemyError as exc:  # the database is down; the next poll tries again
                self.errors += 1
                log.warning("fleet %s catch-up of %s failed: %s", what, self.server_id, exc)
            except Exception:  # an apply that failed (saves that did not finish): next poll again
                self.errors += 1
                log.exception(
                    "fleet %s catch-up of %s failed; retried at the next poll", what, self.server_id
                )


def _libpq_dsn(db_url: str) -> str:
    """The SQLAlchemy URL (`postgresql+psycopg://...`) as a libpq one for a raw psycopg connection."""
    return make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)
