"""How a session deleted on one server reaches the other servers' copies of its pages.

The deleting server, after its own drops (`dss.ops.session_kv`), records one `page_drops` row: the
tenant and the hashes of every page of the session no remaining version of the user reaches. In
the same transaction it deletes every server's page rows of those pages (so a server that is down
finds their files orphaned when it restarts and removes them), deletes the rows every live server
has applied, and notifies (`dss_erasure`, the channel the follower already listens on).

Every server's follower (`ErasureFollower`, one thread) catches up on the rows after its
`servers.page_drop_seq`, in seq order, on every notification and every poll: it drops its own
copies (the callback passed in, `dss.ops.session_kv.Sessions.apply_fleet_drop`) and moves its seq
past the row; its own rows it only steps over. Applying is idempotent, and applying late only costs
a cache miss (a page saved again since is dropped again). Hashes are content addresses in the
tenant's namespace: dropping one never touches another tenant's pages.

No lock here; each database call is its own short transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import transaction
from dss.db.models import HASH_LEN, PageDropRow, ServerRow
from dss.fleet.erasures import CHANNEL
from dss.fleet.members import servers_alive_in
from dss.types import PageHash, TenantId

log = logging.getLogger("dss.fleet")

_BATCH = 200  # rows one catch-up reads at a time


@dataclass(frozen=True, slots=True)
class PageDrop:
    """One recorded deletion: the tenant's pages every other server drops."""

    seq: int
    tenant: TenantId
    pages: tuple[PageHash, ...]


ApplyPageDrop = Callable[[PageDrop], int]
DeletePageRowsIn = Callable[[Session, TenantId, list[PageHash]], None]


class PageDrops:
    """This server's side of the fleet's page drops: `record` (after a deletion here) and
    `catch_up` (the follower thread applies the others')."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        server_id: str,
        alive_s: float,
        delete_page_rows_in: DeletePageRowsIn,
    ) -> None:
        """`delete_page_rows_in(db, tenant, pages)`: every server's rows of those pages, in the
        caller's transaction (`dss.pages.rows.delete_pages_in`; the `pages` table is not ours)."""
        self._sf = session_factory
        self._delete_page_rows_in = delete_page_rows_in
        self.server_id = server_id
        self._alive_s = alive_s
        self.applied = 0  # written by the follower thread only (an int: no torn reads)

    def record(self, tenant: TenantId, pages: Iterable[PageHash]) -> int | None:
        """After a deletion's own drops: the row every other server applies, every server's page
        rows of those pages deleted, applied rows cleaned up, the followers woken (all at commit).
        Returns the row's seq (None: no page to drop)."""
        hashes = sorted(set(pages))
        if not hashes:
            return None
        with transaction(self._sf) as s:
            self._delete_page_rows_in(s, tenant, hashes)
            row = PageDropRow(server=self.server_id, tenant=tenant, hashes=b"".join(hashes))
            s.add(row)
            s.flush()
            seq = int(row.seq)
            self._clean_in(s, seq)
            s.execute(text("SELECT pg_notify(:channel, 'page_drop')"), {"channel": CHANNEL})
        return seq

    def _clean_in(self, s: Session, newest: int) -> None:
        """Delete the rows every other live server has applied (a server that is down rebuilds
        from page rows, already deleted: it needs none of them)."""
        others = [sid for sid in servers_alive_in(s, self._alive_s) if sid != self.server_id]
        low = (
            s.scalar(select(func.min(ServerRow.page_drop_seq)).where(ServerRow.id.in_(others)))
            if others
            else None
        )
        applied_by_all = newest - 1 if low is None else min(int(low), newest - 1)
        s.execute(delete(PageDropRow).where(PageDropRow.seq <= applied_by_all))

    def catch_up(self, apply: ApplyPageDrop, stopping: Callable[[], bool] = lambda: False) -> int:
        """Apply every other server's row after this server's `page_drop_seq`, in seq order, and
        move the seq past it; returns how many were applied."""
        applied = 0
        while not stopping():
            with self._sf() as s:
                after = int(
                    s.scalar(select(ServerRow.page_drop_seq).where(ServerRow.id == self.server_id)) or 0
                )
                rows = s.execute(
                    select(PageDropRow.seq, PageDropRow.server, PageDropRow.tenant, PageDropRow.hashes)
                    .where(PageDropRow.seq > after)
                    .order_by(PageDropRow.seq)
                    .limit(_BATCH)
                ).all()
            if not rows:
                break
            for seq, server, tenant, blob in rows:
                if server == self.server_id:
                    continue  # dropped here already: stepped over with the next advance
                dropped = apply(PageDrop(seq, TenantId(tenant), _split(blob)))
                applied += 1
                log.info("page drop %d of %s applied here: %d page(s)", seq, server, dropped)
                self._advance(seq)  # after each apply: a crash repeats at most this row
            self._advance(rows[-1].seq)
            if len(rows) < _BATCH:
                break
        self.applied += applied
        return applied

    def _advance(self, seq: int) -> None:
        with transaction(self._sf) as s:
            s.execute(
                update(ServerRow)
                .where(ServerRow.id == self.server_id, ServerRow.page_drop_seq < seq)
                .values(page_drop_seq=seq)
            )


def _split(blob: bytes) -> tuple[PageHash, ...]:
    return tuple(PageHash(blob[i : i + HASH_LEN]) for i in range(0, len(blob), HASH_LEN))
