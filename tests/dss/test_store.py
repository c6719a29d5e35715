"""The store facade end to end on real files, shared memory and SQLite."""

from __future__ import annotations

import dataclasses
import stat

import numpy as np
import pytest

from dss.errors import StorageError, WrongMasterKey
from dss.ops.kv import StoredKV
from dss.types import PUBLIC_TENANT, FingerprintId, Tier
from tests.store_helpers import SMALL_FP, load_sequence, open_store, pages_for, put_sequence


def test_put_load_reopen_from_disk(tmp_path):
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    alice = store.identity.tenant_for("alice")
    tokens = np.arange(1, 23, dtype=np.int32)  # 5 full pages of 4 + 2 tokens
    pages = pages_for(SMALL_FP, tokens)
    assert put_sequence(store, fid, alice, tokens, pages) == 5
    assert put_sequence(store, fid, alice, tokens, pages) == 0  # dedup by content address
    n, got = load_sequence(store, fid, alice, tokens)
    assert n == 20 and got == pages
    store.flush()
    # Every tier counts what it holds: the write-through copies on disk too.
    assert store.kv.lookup.residency(fid, alice, tokens) == {"host": 20, "disk": 20, "remote": 0}
    store.check()
    store.close()

    store = open_store(tmp_path)
    assert store.recovery_report is not None and store.recovery_report.pages_indexed == 5
    assert store.kv.lookup.residency(fid, alice, tokens)["disk"] == 20
    n, got = load_sequence(store, fid, alice, tokens)
    assert n == 20 and got == pages
    assert store.kv.lookup.residency(fid, alice, tokens)["host"] == 20  # promoted on hit
    store.check()
    store.close()


def test_tenants_and_fingerprints_never_share(tmp_path):
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    other_fp = store.fingerprints.register(dataclasses.replace(SMALL_FP, isa="amx"))
    alice, bob = store.identity.tenant_for("alice"), store.identity.tenant_for("bob")
    tokens = np.arange(100, 116, dtype=np.int32)
    put_sequence(store, fid, alice, tokens, pages_for(SMALL_FP, tokens))
    assert store.kv.match(fid, alice, tokens).n_tokens == 16
    assert store.kv.match(fid, bob, tokens).n_tokens == 0
    assert store.kv.match(other_fp, alice, tokens).n_tokens == 0
    store.close()


def test_public_prefix_shared_rest_private(tmp_path):
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    system = np.arange(500, 508, dtype=np.int32)  # two pages
    store.prefixes.register(fid, system, text="system prompt", pin=True)
    put_sequence(store, fid, PUBLIC_TENANT, system, pages_for(SMALL_FP, system))
    alice, bob = store.identity.tenant_for("alice"), store.identity.tenant_for("bob")
    a_tokens = np.concatenate([system, np.arange(1, 9, dtype=np.int32)])
    assert store.kv.match(fid, alice, a_tokens).n_tokens == 8  # the public pages
    put_sequence(store, fid, alice, a_tokens, pages_for(SMALL_FP, a_tokens))
    assert store.kv.match(fid, alice, a_tokens).n_tokens == 16
    m = store.kv.match(fid, bob, a_tokens)
    assert m.n_tokens == 8 and m.public_tokens == 8
    # the public pages are pinned: erasing alice leaves them
    receipt = store.eraser.erase_user("alice")
    assert receipt.counts["pages"]["host"] == 2
    assert store.kv.match(fid, bob, a_tokens).n_tokens == 8
    assert store.eraser.verify(receipt.id).remnants == 0
    store.check()
    store.close()


def test_host_pressure_demotes_to_disk_then_promotes(tmp_path):
    page = SMALL_FP.page_nbytes
    store = open_store(tmp_path, host_capacity_bytes=4 * page, write_through=False)
    fid = store.fingerprints.register(SMALL_FP)
    t = store.identity.tenant_for("alice")
    seqs = [np.arange(i * 1000, i * 1000 + 8, dtype=np.int32) for i in range(6)]  # 12 pages > 4 slots
    for s in seqs:
        put_sequence(store, fid, t, s, pages_for(SMALL_FP, s))
    assert store.pages.counters.evictions[Tier.HOST] >= 8
    for s in seqs:
        n, got = load_sequence(store, fid, t, s)
        assert n == 8 and got == pages_for(SMALL_FP, s)
    store.check()
    store.close()


def test_wrong_master_key_refuses_to_start(tmp_path):
    store = open_store(tmp_path)
    store.close()
    (tmp_path / "master.key").write_text("00" * 32)
    with pytest.raises(WrongMasterKey, match=r"master\.key"):
        open_store(tmp_path)


def test_second_owner_refused(tmp_path):
    store = open_store(tmp_path)
    try:
        with pytest.raises(StorageError, match="owns the data directory"):
            open_store(tmp_path)
    finally:
        store.close()


def test_a_new_data_directory_is_private_to_its_owner(tmp_path):
    """It was 0755 with a 0644 database: every message readable by every local user."""
    data = tmp_path / "fresh" / "data"
    store = open_store(data, shm_dir=tmp_path / "shm")
    fid = store.fingerprints.register(SMALL_FP)
    tokens = np.arange(1, 9, dtype=np.int32)
    put_sequence(store, fid, store.identity.tenant_for("alice"), tokens, pages_for(SMALL_FP, tokens))
    store.versions.create_session("alice", "s")
    store.flush()
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in [data, *data.rglob("*")]}
    store.close()
    loose = {str(p.relative_to(tmp_path)): oct(m) for p, m in modes.items() if m & 0o077}
    assert not loose, f"readable by others: {loose}"
    assert any(p.suffix == ".page" for p in modes) and any(p.name == "dss.sqlite3" for p in modes)


def test_stored_kv_counts_each_own_page_once(tmp_path):
    """A tenant's stored KV (`KVCache.lookup.stored`, behind the API's `stored_bytes`): the distinct
    pages its versions' tokens match, public prefix pages and unknown models left out."""
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    page = SMALL_FP.page_nbytes
    system = np.arange(500, 508, dtype=np.int32)  # two public pages
    store.prefixes.register(fid, system, text="system prompt", pin=True)
    put_sequence(store, fid, PUBLIC_TENANT, system, pages_for(SMALL_FP, system))
    alice = store.identity.tenant_for("alice")
    v1 = np.concatenate([system, np.arange(1, 9, dtype=np.int32)])  # + 2 own pages
    v2 = np.concatenate([v1, np.arange(9, 13, dtype=np.int32)])  # its child: + 1 own page
    sibling = np.concatenate([v1, np.arange(40, 44, dtype=np.int32)])  # another child: + 1
    for tokens in (v1, v2, sibling):
        put_sequence(store, fid, alice, tokens, pages_for(SMALL_FP, tokens))
    assert store.kv.lookup.stored(alice, [(fid, v1)]) == StoredKV(2, 2 * page)
    shared_once = StoredKV(4, 4 * page)
    assert store.kv.lookup.stored(alice, [(fid, v1), (fid, v2), (fid, sibling)]) == shared_once
    bob = store.identity.tenant_for("bob")
    assert store.kv.lookup.stored(bob, [(fid, v2)]) == StoredKV(0, 0)  # the public pages are no one's
    assert store.kv.lookup.stored(alice, [(FingerprintId("unknown"), v2)]) == StoredKV(0, 0)
    assert store.kv.lookup.stored(alice, []) == StoredKV(0, 0)
    store.close()


def test_a_session_stores_its_users_own_pages_of_its_versions(tmp_path):
    """`Sessions.stored` (the API's `stored_bytes`) and `Sessions.resident` answer for a
    session's versions: the user's own pages once, the public prefix left out, nothing for a
    session that is not the user's or was deleted, every tier 0 for an unknown model."""
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    page = SMALL_FP.page_nbytes
    system = np.arange(500, 508, dtype=np.int32)  # two public pages
    put_sequence(store, fid, PUBLIC_TENANT, system, pages_for(SMALL_FP, system))
    v1 = np.concatenate([system, np.arange(1, 9, dtype=np.int32)])  # + 2 own pages
    v2 = np.concatenate([v1, np.arange(9, 13, dtype=np.int32)])  # + 1 own page
    store.versions.create_session("alice", "s")
    for head, tokens in enumerate((v1, v2)):
        put_sequence(store, fid, store.identity.tenant_for("alice"), tokens, pages_for(SMALL_FP, tokens))
        store.versions.commit(
            "alice", "s", tokens=tokens, messages=[], branch="main", expected_head=head, fingerprint=fid
        )
    assert store.sessions.stored("alice", "s") == StoredKV(3, 3 * page)
    assert store.sessions.stored("bob", "s") == StoredKV()  # not bob's session
    assert store.sessions.resident_versions("alice", "s", 0, 2)[2]["host"] == len(v2)
    assert set(store.sessions.resident_versions("alice", "s", 1, 2)) == {2}
    assert store.sessions.resident("alice", "unknown", v2) == {t.value: 0 for t in Tier}
    store.sessions.delete("alice", "s")
    assert store.sessions.stored("alice", "s") == StoredKV()
    store.check()
    store.close()
