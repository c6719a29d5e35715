"""Page token ids are user content (the prompt of a sessionless chat, say): the `pages` table must
not hold them in the clear, so neither does any backup of the database. Read like an attacker
with a copy of the database file: search its raw bytes for the pages' token arrays."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select, text

from dss.db.connect import SQLITE_FILENAME
from dss.db.models import PageRow
from tests.store_helpers import SMALL_FP, load_sequence, open_store, pages_for, put_sequence

# Distinctive ids, so a hit in the raw bytes cannot be a coincidence.
TOKENS = np.arange(987_654_000, 987_654_016, dtype=np.int32)  # 4 pages of 4
PUBLIC = np.arange(555_000_000, 555_000_008, dtype=np.int32)


def _raw_database(data_dir: Path) -> bytes:
    out = b""
    for suffix in ("", "-wal", "-shm"):
        p = data_dir / (SQLITE_FILENAME + suffix)
        if p.exists():
            out += p.read_bytes()
    return out


def _page_arrays(tokens: np.ndarray, bs: int) -> list[bytes]:
    return [tokens[i : i + bs].astype("<i4").tobytes() for i in range(0, len(tokens), bs)]


def test_page_token_ids_never_reach_the_database_in_the_clear(tmp_path: Path) -> None:
    data = tmp_path / "data"
    store = open_store(data, shm_dir=tmp_path / "shm")
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for("alice")
    assert put_sequence(store, fid, tenant, TOKENS, pages_for(SMALL_FP, TOKENS)) == 4
    assert store.flush()
    raw = _raw_database(data)
    for arr in _page_arrays(TOKENS, SMALL_FP.block_size):
        assert arr not in raw, "a page's token ids are in the database file in the clear"
    with store.sf() as s:  # what a PostgreSQL dump would show: every column of every row
        rows = [tuple(r) for r in s.execute(select(PageRow.__table__)).all()]
    assert len(rows) == 4
    cells = b"".join(v for r in rows for v in r if isinstance(v, bytes))
    assert not any(arr in cells for arr in _page_arrays(TOKENS, SMALL_FP.block_size))
    store.close()
    raw = _raw_database(data)  # after the WAL is checkpointed into the main file
    assert not any(arr in raw for arr in _page_arrays(TOKENS, SMALL_FP.block_size))

    # A restart rebuilds the index from the rows: the same pages are served, byte for byte.
    store = open_store(data, shm_dir=tmp_path / "shm")
    assert store.recovery_report is not None and store.recovery_report.pages_indexed == 4
    n, got = load_sequence(store, fid, tenant, TOKENS)
    assert n == 16 and got == pages_for(SMALL_FP, TOKENS)
    store.check()
    store.close()


def test_rows_whose_tokens_cannot_be_opened_are_dropped_at_recovery(tmp_path: Path) -> None:
    """A row sealed under another tenant's key (swapped, or its key is gone) is unusable: recovery
    removes it and its file, and the store still checks."""
    data = tmp_path / "data"
    store = open_store(data, shm_dir=tmp_path / "shm")
    fid = store.fingerprints.register(SMALL_FP)
    a, b = store.identity.tenant_for("a"), store.identity.tenant_for("b")
    put_sequence(store, fid, a, TOKENS[:8], pages_for(SMALL_FP, TOKENS[:8]))
    put_sequence(store, fid, b, PUBLIC, pages_for(SMALL_FP, PUBLIC))
    assert store.flush()
    with store.sf.begin() as s:
        row_a = s.execute(select(PageRow).where(PageRow.tenant == a, PageRow.page_index == 0)).scalar_one()
        row_b = s.execute(select(PageRow).where(PageRow.tenant == b, PageRow.page_index == 0)).scalar_one()
        row_a.sealed_tokens, row_b.sealed_tokens = bytes(row_b.sealed_tokens), bytes(row_a.sealed_tokens)
    store.close()
    store = open_store(data, shm_dir=tmp_path / "shm")
    report = store.recovery_report
    assert report is not None and report.pages_indexed == 0 and report.rows_unusable == 4
    assert load_sequence(store, fid, a, TOKENS[:8])[0] == 0
    assert len(os.listdir(data / "pages")) == 0 or not any(
        f for _r, _d, files in os.walk(data / "pages") for f in files
    )
    store.check()
    store.close()


@pytest.mark.pg
def test_page_rows_hold_no_token_ids_on_postgresql(tmp_path: Path, pg_url: str) -> None:
    """What `pg_dump` would show: every cell of every `pages` row, raw."""
    data = tmp_path / "data"
    store = open_store(data, shm_dir=tmp_path / "shm", db_url=pg_url)
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for("alice")
    assert put_sequence(store, fid, tenant, TOKENS, pages_for(SMALL_FP, TOKENS)) == 4
    assert store.flush()
    with store.db.connect() as conn:
        dump = conn.execute(text("SELECT * FROM pages")).all()
    assert len(dump) == 4
    cells = b"".join(bytes(v) for r in dump for v in r if isinstance(v, bytes | memoryview))
    assert not any(arr in cells for arr in _page_arrays(TOKENS, SMALL_FP.block_size))
    store.close()
    store = open_store(data, shm_dir=tmp_path / "shm", db_url=pg_url)
    assert load_sequence(store, fid, tenant, TOKENS) == (16, pages_for(SMALL_FP, TOKENS))
    store.check()
    store.close()
