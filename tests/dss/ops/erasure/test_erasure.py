"""Erasing a user: receipts, verification, and a grep of every tier and the database."""

from __future__ import annotations

import os
import shutil

import numpy as np

from dss.types import PUBLIC_TENANT
from tests.store_helpers import SMALL_FP, open_store, pages_for, put_sequence

MARKER = "zebra-umbrella-7731"  # a message text we grep for after the erase


def _fill_user(store, fid, user: str, n_sessions: int = 3, n_versions: int = 3) -> list[np.ndarray]:
    tenant = store.identity.tenant_for(user)
    seqs = []
    for s in range(n_sessions):
        info = store.versions.create_session(user, system_prompt=f"{MARKER} system")
        tokens = np.array([], dtype=np.int32)
        for v in range(n_versions):
            tokens = np.concatenate(
                [tokens, np.arange(7000 + 100 * s + 10 * v, 7000 + 100 * s + 10 * v + 8, dtype=np.int32)]
            )
            store.versions.commit(
                user, info.id, tokens=tokens, messages=[{"role": "user", "content": f"{MARKER} turn {v}"}]
            )
            put_sequence(store, fid, tenant, tokens, pages_for(SMALL_FP, tokens))
        seqs.append(tokens)
    return seqs


def _grep(path, needle: bytes) -> list[str]:
    hits = []
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            try:
                with open(p, "rb") as fh:
                    if needle in fh.read():
                        hits.append(p)
            except OSError:
                pass
    return hits


def test_erase_user_leaves_no_remnants(tmp_path):
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    fid = store.fingerprints.register(SMALL_FP)
    seqs = _fill_user(store, fid, "alice")
    bob_tokens = np.arange(9000, 9016, dtype=np.int32)
    put_sequence(store, fid, store.identity.tenant_for("bob"), bob_tokens, pages_for(SMALL_FP, bob_tokens))
    store.flush()
    alice_page = pages_for(SMALL_FP, seqs[0])[0]
    assert _grep(tmp_path / "shm", alice_page[:64]), "the test must see the page in shared memory first"
    assert _grep(tmp_path / "data", MARKER.encode()), "and the messages in the database"
    assert _grep(tmp_path / "data", seqs[0][:8].tobytes()), "and the tokens"

    receipt = store.eraser.erase_user("alice")
    assert receipt.counts["sessions"] == 3
    assert receipt.counts["versions"] == 9
    assert receipt.counts["pages"]["host"] > 0 and receipt.counts["pages"]["disk"] > 0
    assert "alice" not in repr(receipt)
    v = store.eraser.verify(receipt.id)
    assert v.remnants == 0 and v.chain_ok, v.details

    assert store.versions.list_sessions("alice")[0] == []
    for tokens in seqs:
        assert store.kv.match(fid, store.identity.tenant_for("alice"), tokens).n_tokens == 0
    assert (
        store.kv.match(fid, store.identity.tenant_for("bob"), bob_tokens).n_tokens == 16
    )  # others untouched
    # grep every tier and the database files for the user's content
    assert _grep(tmp_path / "shm", alice_page[:64]) == []
    assert _grep(tmp_path / "data", MARKER.encode()) == []
    assert _grep(tmp_path / "data", seqs[0][:8].tobytes()) == []
    store.check()
    store.close()


def test_verification_finds_planted_remnants(tmp_path):
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    fid = store.fingerprints.register(SMALL_FP)
    _fill_user(store, fid, "carol", n_sessions=1, n_versions=2)
    store.flush()
    # an operator's "backup" of one page file, taken before the erase
    some_file = next(p for p in (tmp_path / "data" / "pages").rglob("*.page"))
    backup = tmp_path / "backup.page"
    shutil.copy2(some_file, backup)
    receipt = store.eraser.erase_user("carol")
    assert store.eraser.verify(receipt.id).remnants == 0

    shutil.copy2(backup, some_file)  # the backup is restored into the disk tier
    v = store.eraser.verify(receipt.id)
    assert v.remnants == 1 and "disk" in v.details[0]
    # and the restored copy is unreadable: its data key was destroyed
    store.close()
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    assert not some_file.exists(), "recovery removes pages whose tenant has no data key"
    store.close()


def test_receipts_form_a_hash_chain(tmp_path):
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    receipts = []
    for user in ("u1", "u2", "u3"):
        _fill_user(store, fid, user, n_sessions=1, n_versions=1)
        receipts.append(store.eraser.erase_user(user))
    assert [r.seq for r in receipts] == [1, 2, 3]
    assert receipts[1].prev_hash == receipts[0].entry_hash
    assert all(store.eraser.verify(r.id).chain_ok for r in receipts)
    # tampering with an old receipt breaks verification of every later one
    from dss.db.models import ErasureReceiptRow

    with store.sf() as s, s.begin():
        row = s.get(ErasureReceiptRow, receipts[0].id)
        row.counts = {**row.counts, "sessions": 99}
    v = store.eraser.verify(receipts[2].id)
    assert not v.chain_ok and v.remnants >= 1
    store.close()


def test_recreated_user_starts_cold(tmp_path):
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    seqs = _fill_user(store, fid, "dave", n_sessions=1, n_versions=1)
    receipt = store.eraser.erase_user("dave")
    tenant = store.identity.tenant_for("dave")
    assert store.kv.match(fid, tenant, seqs[0]).n_tokens == 0
    put_sequence(store, fid, tenant, seqs[0], pages_for(SMALL_FP, seqs[0]))  # new data after the erase
    assert store.eraser.verify(receipt.id).remnants == 0  # new data is not a remnant
    assert store.kv.match(fid, PUBLIC_TENANT, seqs[0]).n_tokens == 0
    store.close()


def test_a_busy_reader_is_reported_and_the_wal_is_scrubbed_once_it_is_gone(tmp_path):
    import sqlite3

    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    fid = store.fingerprints.register(SMALL_FP)
    _fill_user(store, fid, "alice", n_sessions=1)
    store.flush()
    # A reader holding a snapshot from before the erasure keeps the checkpoint from finishing:
    # the erased rows then stay in the WAL, and the receipt must say so instead of assuming.
    reader = sqlite3.connect(tmp_path / "data" / "dss.sqlite3")
    reader.execute("BEGIN")
    assert reader.execute("SELECT count(*) FROM sessions").fetchone()[0] == 1
    receipt = store.eraser.erase_user("alice")
    assert receipt.database_scrubbed is False
    held = store.eraser.verify(receipt.id)
    assert held.database_scrubbed is False and any("WAL" in d for d in held.details)
    reader.rollback()
    reader.close()
    v = store.eraser.verify(receipt.id)
    assert v.database_scrubbed is True and v.remnants == 0, v.details
    assert os.path.getsize(tmp_path / "data" / "dss.sqlite3-wal") == 0
    assert _grep(tmp_path / "data", MARKER.encode()) == []
    store.close()


def test_a_receipt_of_an_earlier_run_verifies_whatever_reader_is_busy_now(tmp_path):
    """The store scrubs the WAL when it opens, before its threads start: a receipt of an earlier
    run is known to be scrubbed, so verifying it never depends on a reader (the retention sweeper,
    a client) happening to hold a snapshot at that moment (CI, s42: a false remnant)."""
    import sqlite3

    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    fid = store.fingerprints.register(SMALL_FP)
    _fill_user(store, fid, "alice", n_sessions=1)
    receipt = store.eraser.erase_user("alice")
    store.close()
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm")
    _fill_user(store, store.fingerprints.register(SMALL_FP), "bob", n_sessions=1)  # frames in the WAL
    reader = sqlite3.connect(tmp_path / "data" / "dss.sqlite3")
    try:
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM sessions").fetchone()[0] == 1
        v = store.eraser.verify(receipt.id)
        assert v.database_scrubbed is True and v.remnants == 0, v.details
    finally:
        reader.rollback()
        reader.close()
        store.close()
