"""Who is in the fleet: this server's id, its registration and its heartbeat.

Several `dss serve` processes, each with its own data directory, may share one PostgreSQL
database. Each has a stable id (`StoreConfig.server_id`, else the one its data directory keeps in
`server-id`): its page rows carry it, and its erasure acknowledgements are signed with it.

A server registers in `servers` at open and refreshes `last_seen` every `heartbeat_s` from a
daemon thread; "alive" means seen within `alive_s`, measured by the database's clock (servers'
clocks may disagree; the database's is the one all of them read). An erasure waits for the
acknowledgements of the servers alive when it committed.

No lock here: the heartbeat thread owns nothing but its stop event, and every call is its own
short transaction.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import socket
import threading
from datetime import timedelta
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from dss.db import receipt_rows
from dss.db.connect import transaction
from dss.db.models import SERVER_ID_LEN, ServerRow

log = logging.getLogger("dss.fleet")

SERVER_ID_FILE = "server-id"
_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")


def resolve_server_id(configured: str | None, data_dir: Path) -> str:
    """The configured id, else the one recorded in `data_dir/server-id`, else a new random
    `srv-<12 hex>` written there (0600, created exclusively: two racing first starts agree)."""
    if configured is not None:
        return _checked(configured, "StoreConfig.server_id")
    path = data_dir / SERVER_ID_FILE
    new = f"srv-{secrets.token_hex(6)}"
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(new + "\n")
            f.flush()
            os.fsync(f.fileno())
    return _checked(path.read_text().strip(), str(path))


def _checked(server_id: str, source: str) -> str:
    if not 0 < len(server_id) <= SERVER_ID_LEN or not _ID_PATTERN.match(server_id):
        raise ValueError(
            f"{source}: a server id is 1-{SERVER_ID_LEN} letters, digits or ._:- (got {server_id!r})"
        )
    return server_id


class Membership:
    """This server's row in `servers`, and the fleet as the database sees it."""

    def __init__(
        self, session_factory: sessionmaker[Session], server_id: str, heartbeat_s: float, alive_s: float
    ) -> None:
        self._sf = session_factory
        self.server_id = server_id
        self._heartbeat_s = heartbeat_s
        self._alive_s = alive_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.heartbeat_errors = 0  # only the heartbeat thread writes it

    def register(self) -> None:
        """At open, before the keyring reads the retired tenants: a server new to the fleet starts
        its catch-up after the receipts written so far (their tenants have no data key any more,
        so recovery drops their pages and the keyring retires them); a known one keeps its
        `erasure_seq`, so it applies what it missed while it was down."""
        host = socket.gethostname()[:256]
        with transaction(self._sf) as s:
            row = s.get(ServerRow, self.server_id)
            if row is not None:
                s.execute(
                    update(ServerRow)
                    .where(ServerRow.id == self.server_id)
                    .values(started_at=func.now(), last_seen=func.now(), host=host)
                )
                return
        last = self.last_receipt_seq()
        try:
            with transaction(self._sf) as s:
                s.add(ServerRow(id=self.server_id, erasure_seq=last, host=host))
        except IntegrityError:
            pass  # registered meanwhile by a process with the same id: the row exists

    def last_receipt_seq(self) -> int:
        with self._sf() as s:
            return receipt_rows.last_seq_in(s)

    def beat(self) -> None:
        with transaction(self._sf) as s:
            s.execute(update(ServerRow).where(ServerRow.id == self.server_id).values(last_seen=func.now()))

    def alive_in(self, db: Session) -> list[str]:
        """Servers seen within `alive_s` (this one included), read in the caller's transaction."""
        return servers_alive_in(db, self._alive_s)

    def erasure_seq(self) -> int:
        with self._sf() as s:
            row = s.get(ServerRow, self.server_id)
            return int(row.erasure_seq) if row is not None else 0

    # ------------------------------------------------------------------ heartbeat thread
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dss-fleet-heartbeat", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the heartbeat. `last_seen` is left as it is: a server that stopped a moment ago
        still counts as alive for `alive_s`, exactly like one that was killed (its disk tier
        still holds whatever it held; it acknowledges erasures when it is back)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            try:
                self.beat()
            except SQLAlchemyError as exc:  # the database is down: try again next beat
                self.heartbeat_errors += 1
                log.warning("fleet heartbeat of %s failed: %s", self.server_id, exc)


def servers_alive_in(s: Session, alive_s: float) -> list[str]:
    """The ids of the servers seen within `alive_s`, by the database's clock, in the caller's
    transaction (a master-key rotation refuses while any is)."""
    since = func.now() - timedelta(seconds=alive_s)
    return sorted(s.execute(select(ServerRow.id).where(ServerRow.last_seen >= since)).scalars())
