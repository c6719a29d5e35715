"""What verifying one erasure costs on a store with a long receipt chain and many page files of
other users: the bounded verification (chain since its last checkpoint, the tenant's indexed
files) against the full audit (`full=True`: the chain from its start, every page file's header,
which is what every verification did before). Same store, same run.

    python bench/verify.py [--receipts 20000] [--page-files 8000] [--session-users 500] [--warm]

Also what one verification sends to the database with 10 users holding sessions and with
`--session-users` of them: statements and rows fetched, and their ratio (1.0: independent of the
number of users).

Page files are evicted from the page cache before each timed run (fsync + POSIX_FADV_DONTNEED,
no root needed) unless --warm; directory entries stay cached either way.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from sqlalchemy import event

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dss.config import StoreConfig
from dss.db.connect import transaction
from dss.db.models import ErasureReceiptRow
from dss.namespace import ModelFingerprint
from dss.ops.erasure.chain import GENESIS, entry_hash
from dss.store import Store
from dss.types import UserId
from tests.store_helpers import put_sequence

FP = ModelFingerprint(
    model_id="bench",
    revision="1",
    dtype="bfloat16",
    num_layers=2,
    num_kv_heads=2,
    head_size=16,
    block_size=16,
)
PAGES_PER_SEQUENCE = 16


def _open(d: Path) -> Store:
    return Store.open(StoreConfig(data_dir=d, fsync=False, host_capacity_bytes=1 << 28))


def _fill_chain(store: Store, n: int) -> None:
    """`n` receipts of earlier erasures, hash-chained as `erasure_receipts.append_receipt` writes them."""
    prev, at = GENESIS, datetime.now(UTC)
    with transaction(store.sf) as s:
        for seq in range(1, n + 1):
            rid, counts = f"era_bench{seq:09d}", {"sessions": 1}
            entry = entry_hash(prev, rid, seq, at, "f" * 64, counts)
            row = ErasureReceiptRow(id=rid, seq=seq, erased_at=at, subject="f" * 64, counts=counts)
            row.prev_hash, row.entry_hash = prev, entry
            s.add(row)
            prev = entry


def _fill_pages(store: Store, user: str, n_pages: int, seed: int) -> None:
    fid = store.fingerprints.register(FP)
    tenant = store.identity.tenant_for(user)
    rng = np.random.default_rng(seed)
    page = rng.integers(0, 255, FP.page_nbytes, dtype=np.uint8).tobytes()
    for _ in range(max(1, n_pages // PAGES_PER_SEQUENCE)):
        tokens = rng.integers(0, 50_000, PAGES_PER_SEQUENCE * FP.block_size, dtype=np.int32)
        put_sequence(store, fid, tenant, tokens, [page] * PAGES_PER_SEQUENCE)


def _evict(root: Path) -> None:
    for f in root.rglob("*.page"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(store: Store, rid: str, full: bool, pages: Path, warm: bool, runs: int) -> tuple[float, int, bool]:
    times, remnants, chain_ok = [], 0, True
    for _ in range(runs):
        if not warm:
            _evict(pages)
        t0 = time.perf_counter()
        v = store.eraser.verify(rid, full=full)
        times.append(time.perf_counter() - t0)
        remnants, chain_ok = v.remnants, v.chain_ok
    return statistics.median(times), remnants, chain_ok


def _db_cost(store: Store, rid: str) -> tuple[int, int]:
    """Statements one verification sends (this thread's) and the rows they return (the reads
    run again afterwards: nothing changed since)."""
    sent: list[tuple[str, object]] = []
    me = threading.get_ident()

    def on_execute(_conn: object, _cursor: object, statement: str, parameters: object, *_: object) -> None:
        if threading.get_ident() == me:
            sent.append((statement, parameters))

    event.listen(store.db, "before_cursor_execute", on_execute)
    try:
        store.eraser.verify(rid)
    finally:
        event.remove(store.db, "before_cursor_execute", on_execute)
    with store.db.connect() as conn:
        rows = sum(
            len(conn.exec_driver_sql(st, params).fetchall())  # type: ignore[arg-type]
            for st, params in sent
            if st.lstrip().upper().startswith("SELECT")
        )
    return len(sent), rows


def _add_session_users(store: Store, first: int, last: int) -> None:
    for i in range(first, last):
        store.versions.create_session(UserId(f"session-user-{i}"), "s1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--receipts", type=int, default=20_000)
    ap.add_argument("--page-files", type=int, default=8_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--session-users", type=int, default=500)
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (the suite runs this)")
    args = ap.parse_args()
    if args.smoke:
        args.receipts, args.page_files, args.runs, args.session_users = 200, 80, 1, 50
    print(f"cores={os.cpu_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        store = _open(d)
        t0 = time.perf_counter()
        _fill_chain(store, args.receipts)
        users = 20
        for u in range(users):
            _fill_pages(store, f"other-{u}", args.page_files // users, u)
        _fill_pages(store, "alice", 32, 1000)
        _fill_pages(store, "bob", 32, 1001)
        store.flush()
        store.close()
        print(f"fill_s={time.perf_counter() - t0:.1f}")
        store = _open(d)  # a restart: recovery reads every header once
        pages = d / "pages"
        n_files = sum(1 for _ in pages.rglob("*.page"))
        first = store.eraser.erase_user("alice")
        t0 = time.perf_counter()
        store.eraser.verify(first.id)  # the first after an upgrade walks the chain once, sealing
        first_s = time.perf_counter() - t0
        receipt = store.eraser.erase_user("bob")
        verify_s, remnants, ok = _timed(store, receipt.id, False, pages, args.warm, args.runs)
        full_s, full_remnants, full_ok = _timed(store, receipt.id, True, pages, args.warm, args.runs)
        _add_session_users(store, 0, 10)
        few = _db_cost(store, receipt.id)
        _add_session_users(store, 10, args.session_users)
        many = _db_cost(store, receipt.id)
        store.close()
    print(
        f"verify_first_s={first_s:.3f} remnants={remnants} chain_ok={ok} "
        f"full_remnants={full_remnants} full_chain_ok={full_ok} cache={'warm' if args.warm else 'cold'}"
    )
    print(f"db_cost users=10 statements={few[0]} rows={few[1]}")
    print(f"db_cost users={args.session_users} statements={many[0]} rows={many[1]}")
    print(
        f"RESULT verify_s={verify_s:.4f} verify_s_full_scan={full_s:.3f} "
        f"receipts={args.receipts + 2} page_files={n_files} "
        f"db_rows_ratio_{args.session_users}_vs_10_users={many[1] / few[1]:.2f} "
        f"db_statements_ratio={many[0] / few[0]:.2f}"
    )


if __name__ == "__main__":
    main()
