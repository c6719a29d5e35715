"""Corrupt or missing page files, an unusable disk tier, PostgreSQL metadata, and the RPC path."""

from __future__ import annotations

import multiprocessing as mp
import random
import time

import numpy as np
import pytest

from dss.config import StoreConfig
from dss.store import Store
from tests.store_helpers import SMALL_FP, disk_only_store, load_sequence, open_store, pages_for, put_sequence


@pytest.mark.parametrize("damage", ["flip", "truncate", "zero"])
def test_corrupt_page_is_never_served(tmp_path, damage):
    tokens, pages = disk_only_store(tmp_path)
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for("alice")
    victim_index = 6
    victim = store.kv.match(fid, tenant, tokens).pages[victim_index]
    path = store.disk.path_of(victim)
    blob = bytearray(path.read_bytes())
    rng = random.Random(7)
    if damage == "flip":
        for _ in range(3):
            blob[rng.randrange(len(blob))] ^= 0xFF
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    else:
        blob[-64:] = b"\x00" * 64
    path.write_bytes(bytes(blob))

    n, got = load_sequence(store, fid, tenant, tokens)
    assert n == victim_index * SMALL_FP.block_size
    assert got == pages[:victim_index]  # exact bytes up to the damaged page, nothing after
    assert store.stats()["corrupt_pages"] >= 1
    assert not path.exists(), "a corrupt page file is deleted"
    store.check()
    # the KV is recomputable: storing it again heals the sequence
    put_sequence(store, fid, tenant, tokens, pages)
    assert load_sequence(store, fid, tenant, tokens) == (40, pages)
    store.close()


def test_missing_page_file_is_a_miss_after_restart(tmp_path):
    tokens, pages = disk_only_store(tmp_path)
    files = sorted((tmp_path / "pages").rglob("*.page"))
    files[0].unlink()  # some page vanished (operator error, fs damage)
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    _n, got = load_sequence(store, fid, store.identity.tenant_for("alice"), tokens)
    assert got == pages[: len(got)]
    assert store.recovery_report.rows_without_file == 1
    store.check()
    store.close()


def test_unusable_disk_tier_keeps_serving_from_memory(tmp_path):
    store = open_store(tmp_path)
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for("alice")
    # every fan-out directory name is taken by a plain file: writes fail even for root
    for i in range(256):
        d = store.disk.root / f"{i:02x}"
        if not d.exists():
            d.write_bytes(b"")
    tokens = np.arange(1, 17, dtype=np.int32)
    pages = pages_for(SMALL_FP, tokens)
    put_sequence(store, fid, tenant, tokens, pages)
    store.flush()
    stats = store.stats()
    assert stats["disk_available"] is False and stats["disk_write_errors"] >= 1
    assert load_sequence(store, fid, tenant, tokens) == (16, pages)
    store.close()


@pytest.mark.pg
def test_store_on_postgresql(tmp_path, pg_url):
    cfg = StoreConfig(data_dir=tmp_path, db_url=pg_url, fsync=False, host_capacity_bytes=1 << 22)
    store = Store.open(cfg)
    assert store.write_gate is None  # a row lock of PostgreSQL may be waited for anywhere
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for("alice")
    sid = store.versions.create_session("alice").id
    tokens = np.arange(1, 25, dtype=np.int32)
    store.versions.commit("alice", sid, tokens=tokens, messages=[{"role": "user", "content": "hi"}])
    pages = pages_for(SMALL_FP, tokens)
    put_sequence(store, fid, tenant, tokens, pages)
    store.close()
    store = Store.open(cfg)
    assert load_sequence(store, fid, tenant, tokens) == (24, pages)
    receipt = store.eraser.erase_user("alice")
    assert store.eraser.verify(receipt.id).remnants == 0
    assert receipt.counts["versions"] == 1 and receipt.counts["pages"]["disk"] == 6
    store.check()
    store.close()


def _engine_side(address: str, authkey: bytes, fp_json: str, tenant: str, q) -> None:
    """Plays vLLM's processes: save pages through the arena, then load them back."""
    from dss.namespace import ModelFingerprint
    from dss.pages.tiers.host import HostArena
    from dss.rpc import StoreClient

    fp = ModelFingerprint.from_json(fp_json)
    client = StoreClient(address, authkey)
    fid = client.register_fingerprint(fp)
    tokens = np.arange(50, 70, dtype=np.int32)
    pages = pages_for(fp, tokens)
    plan = client.plan_save(fid, tenant, tokens, 5)
    arenas: dict[str, HostArena] = {}
    for ps in plan.pages:
        ref = ps.slot
        arena = arenas.get(ref.path) or HostArena.attach(ref.path, ref.slot_nbytes, ref.n_slots)
        arenas[ref.path] = arena
        arena.view(ref.slot)[:] = pages[ps.page_index]
    written = client.commit_save(plan.save_id, [ps.page_index for ps in plan.pages])
    load = client.begin_load(fid, tenant, tokens, 0, len(tokens))
    loaded = []
    for ps in client.wait_loaded(load.load_id, 10.0):
        ref = ps.slot
        arena = arenas.get(ref.path) or HostArena.attach(ref.path, ref.slot_nbytes, ref.n_slots)
        arenas[ref.path] = arena
        loaded.append(bytes(arena.view(ref.slot)))
    client.release(load.load_id)
    q.put((written, len(loaded), loaded == pages[: len(loaded)]))


def test_rpc_from_another_process(tmp_path):
    store = open_store(tmp_path)
    address, authkey = store.serve_rpc()
    tenant = store.identity.tenant_for("alice")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_engine_side, args=(address, authkey, SMALL_FP.to_json(), tenant, q))
    p.start()
    written, n_loaded, same = q.get(timeout=120)
    p.join(30)
    assert (written, n_loaded, same) == (5, 5, True)
    fid = SMALL_FP.id
    tokens = np.arange(50, 70, dtype=np.int32)
    assert load_sequence(store, fid, tenant, tokens) == (20, pages_for(SMALL_FP, tokens))
    assert store.stats()["leases"] == 0
    store.check()
    store.close()


def test_rpc_rejects_wrong_authkey(tmp_path):
    from dss.rpc import StoreClient, StoreUnavailable

    store = open_store(tmp_path)
    address, _ = store.serve_rpc()
    client = StoreClient(address, b"not the key")
    with pytest.raises(StoreUnavailable):
        client.ping()
    assert StoreClient(address, store.serve_rpc()[1]).ping()
    store.close()


def test_abandoned_leases_and_saves_expire(tmp_path):
    store = open_store(tmp_path, lease_timeout_s=0.5)
    fid = store.fingerprints.register(SMALL_FP)
    tenant = store.identity.tenant_for("alice")
    tokens = np.arange(1, 9, dtype=np.int32)
    put_sequence(store, fid, tenant, tokens, pages_for(SMALL_FP, tokens))
    store.kv.begin_load(fid, tenant, tokens)  # an engine that died before releasing
    store.kv.plan_save(fid, tenant, np.arange(100, 108, dtype=np.int32), 2)  # ... or before committing
    assert store.stats()["leases"] == 1 and store.stats()["pending_saves"] == 1
    time.sleep(0.6)
    store.kv.begin_load(fid, tenant, tokens)  # the next request sweeps the stale ones
    assert store.stats()["leases"] == 1 and store.stats()["pending_saves"] == 0
    assert all(e.leases <= 1 for e in store.pages.table.snapshot())
    store.close()


def test_closing_the_rpc_server_hangs_up_clients(tmp_path):
    from dss.rpc import StoreClient, StoreUnavailable

    store = open_store(tmp_path)
    address, authkey = store.serve_rpc()
    client = StoreClient(address, authkey)
    assert client.ping()
    store.close()
    with pytest.raises(StoreUnavailable):
        client.ping()
    store = open_store(tmp_path)  # a new owner of the same data directory: same address and key
    assert store.serve_rpc() == (address, authkey)
    time.sleep(1.1)  # past the client's back-off after the failed call
    assert client.ping()  # the same client reconnects
    store.close()


def test_a_server_makes_its_engines_host_arena_before_it_serves(tmp_path):
    """Before: the first save made the arena (reserving the host tier's whole size in /dev/shm)
    inside the store call an engine step waits for: 0.5 s for 2 GiB, paid by the first turn
    after every start. `dss serve` now asks for it at start-up (`api.llm.startup`)."""
    store = open_store(tmp_path)
    try:
        arena = store.pages.host.directory / f"arena-{SMALL_FP.page_nbytes}.shm"
        fid = store.fingerprints.register(SMALL_FP)
        assert not arena.exists()
        store.prepare_pages(fid)
        assert arena.exists()
        store.prepare_pages(fid)  # made once
    finally:
        store.close()
