"""Pages of tensor- and pipeline-parallel engines: one page, one segment per rank.

Each rank copies its own shard (its KV heads, its layers) of every page into the same slot;
the store publishes a page only when every rank committed it, frees a save's slots only when
every rank reported, and keeps a load's pages pinned until every rank released it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from dss.errors import InvalidInput
from dss.namespace import ModelFingerprint
from dss.pages.tiers.host import HostArena
from dss.store import Store
from dss.types import TenantId
from engine_patch.connector.copy import ArenaViews, KVBlocks, runs
from engine_patch.connector.layouts import VLLM_AXES, KVLayout
from tests.store_helpers import SMALL_FP, open_store

L, NB, H, BS, HD = 4, 12, 4, 8, 16
CPU = KVLayout(VLLM_AXES, NB, packed=True)  # the CPU backend's blocks: bytes as they are
TP, PP = 2, 2
FULL = ModelFingerprint("tiny", "r", "bfloat16", num_layers=L, num_kv_heads=H, head_size=HD, block_size=BS)
SHARDED = ModelFingerprint(
    "tiny",
    "r",
    "bfloat16",
    num_layers=L,
    num_kv_heads=H // TP,
    head_size=HD,
    block_size=BS,
    tp_size=TP,
    pp_size=PP,
)


def test_a_single_rank_fingerprint_keeps_its_id_and_a_parallel_one_differs() -> None:
    # The id SMALL_FP had before the layout fields existed: stored pages stay reachable.
    assert SMALL_FP.id == "282e3c12e36b58a406ae5e4e86e11415"
    assert SHARDED.shards == TP * PP
    assert SHARDED.page_nbytes == FULL.page_nbytes  # the same bytes, split among the ranks
    assert SHARDED.layer_row_nbytes == TP * SHARDED.layer_block_nbytes
    assert SHARDED.id != FULL.id
    assert ModelFingerprint.from_json(SHARDED.to_json()) == SHARDED
    with pytest.raises(ValueError):
        ModelFingerprint(
            "m", "r", "bfloat16", num_layers=2, num_kv_heads=1, head_size=8, block_size=4, pp_size=3
        )


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[HostArena]:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    a = HostArena.create(
        shm / f"dss-test-shards-{os.getpid()}-{time.monotonic_ns()}.shm", SHARDED.page_nbytes, 8
    )
    try:
        yield a
    finally:
        a.close()
        a.path.unlink(missing_ok=True)


NHD = KVLayout(VLLM_AXES, NB)  # a CUDA engine's LBNHC view: pages in the canonical [H, N, C]


def _full_layers(seed: int, physical: str = "BHNC") -> list[torch.Tensor]:
    """`[B, H, N, C]` views whose memory is in `physical` order (HND: the CPU backend; NHD:
    FlashAttention's)."""
    g = torch.Generator().manual_seed(seed)
    shape = {"B": NB, "H": H, "N": BS, "C": 2 * HD}
    out = []
    for _ in range(L):
        t = torch.randn(*(shape[a] for a in physical), generator=g).to(torch.bfloat16)
        out.append(t.permute(*(physical.index(a) for a in "BHNC")))
    return out


def _rank_layers(full: list[torch.Tensor], tp_rank: int, pp_rank: int) -> dict[int, torch.Tensor]:
    """What rank (tp_rank, pp_rank) holds: its heads of its stage's layers, in the same memory
    order as the whole model's tensors."""
    per_stage, heads = L // PP, H // TP
    return {
        i: full[i][:, tp_rank * heads : (tp_rank + 1) * heads].clone()
        for i in range(pp_rank * per_stage, (pp_rank + 1) * per_stage)
    }


@pytest.mark.parametrize(("layout", "physical"), [(CPU, "BHNC"), (NHD, "BNHC")], ids=["cpu-packed", "nhd"])
def test_every_rank_writes_its_shard_and_loads_it_back(
    arena: HostArena, layout: KVLayout, physical: str
) -> None:
    full = _full_layers(1, physical)
    pages = ArenaViews(SHARDED.num_layers, SHARDED.layer_row_nbytes).pages(
        str(arena.path), SHARDED.page_nbytes
    )
    block_ids, slots = [3, 4, 7], [0, 1, 5]
    ranks = [(t, p) for p in range(PP) for t in range(TP)]
    for t, p in ranks:
        KVBlocks(_rank_layers(full, t, p), layout, num_layers=L, segment=t, segments=TP).save(
            pages, runs(block_ids, slots)
        )

    # A layer's row is the rank segments in head order: the whole block, as a single-rank engine
    # of the same layout holds it (both forms are head-major).
    whole = [torch.zeros_like(kv) for kv in full]
    KVBlocks(whole, layout).load(pages, runs(block_ids, slots))
    for layer in range(L):
        assert torch.equal(whole[layer][block_ids], full[layer][block_ids])

    for t, p in ranks:
        mine = {i: torch.zeros_like(kv) for i, kv in _rank_layers(full, t, p).items()}
        KVBlocks(mine, layout, num_layers=L, segment=t, segments=TP).load(pages, runs([0, 1, 2], slots))
        for i, kv in _rank_layers(full, t, p).items():
            assert torch.equal(mine[i][:3], kv[block_ids]), (t, p, i)


def test_a_rank_refuses_layers_or_segments_outside_the_page() -> None:
    full = _full_layers(2)
    with pytest.raises(InvalidInput):
        KVBlocks({L: full[0]}, CPU, num_layers=L)
    with pytest.raises(InvalidInput):
        KVBlocks(_rank_layers(full, 0, 0), CPU, num_layers=L, segment=TP, segments=TP)


# ---------------------------------------------------------------------------- the store's side
ALICE = TenantId("alice-tenant")
TP_FP = ModelFingerprint(
    "tiny-test", "r1", "bfloat16", num_layers=2, num_kv_heads=1, head_size=8, block_size=4, tp_size=2
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(tmp_path / "data", write_through=False)
    try:
        yield s
    finally:
        s.close()


def _fill(store: Store, plan_slots: list[object], value: int) -> None:
    for ref in plan_slots:
        store.pages.host.slot_array(ref)[:] = value  # type: ignore[arg-type]


def test_a_page_is_published_only_when_every_rank_committed_it(store: Store) -> None:
    fid = store.fingerprints.register(TP_FP)
    tokens = np.arange(1, 13, dtype=np.int32)  # 3 pages
    plan = store.kv.plan_save(fid, ALICE, tokens, 3)
    assert len(plan.pages) == 3
    _fill(store, [p.slot for p in plan.pages], 7)
    assert store.kv.saves.commit_save(plan.save_id, [0, 1, 2], shard=0) == 0  # rank 1 has not reported
    assert store.kv.match(fid, ALICE, tokens).n_tokens == 0
    assert len(store.kv.saves.pending_slots()) == 3
    # Rank 1 copied only pages 0 and 1: page 2 is not whole, so it is not published.
    assert store.kv.saves.commit_save(plan.save_id, [0, 1], shard=1) == 2
    assert store.kv.match(fid, ALICE, tokens).n_tokens == 8
    assert store.kv.saves.pending_slots() == []


def test_one_rank_aborting_publishes_nothing_and_frees_after_the_last_report(store: Store) -> None:
    fid = store.fingerprints.register(TP_FP)
    tokens = np.arange(1, 9, dtype=np.int32)
    before = store.pages.used_bytes()
    plan = store.kv.plan_save(fid, ALICE, tokens, 2)
    store.kv.saves.abort_save(plan.save_id, shard=1)
    # Rank 0 may still be copying into the slots: they stay reserved until it reports.
    assert len(store.kv.saves.pending_slots()) == 2
    assert store.kv.saves.commit_save(plan.save_id, [0, 1], shard=0) == 0
    assert store.kv.saves.pending_slots() == []
    assert store.pages.used_bytes() == before
    assert store.kv.match(fid, ALICE, tokens).n_tokens == 0
    with pytest.raises(InvalidInput):
        store.kv.saves.commit_save(store.kv.plan_save(fid, ALICE, tokens, 2).save_id, [0], shard=2)


def test_a_load_stays_pinned_until_every_rank_released_it(store: Store) -> None:
    fid = store.fingerprints.register(TP_FP)
    tokens = np.arange(1, 13, dtype=np.int32)
    plan = store.kv.plan_save(fid, ALICE, tokens, 3)
    _fill(store, [p.slot for p in plan.pages], 3)
    store.kv.saves.commit_save(plan.save_id, [0, 1, 2], shard=0)
    store.kv.saves.commit_save(plan.save_id, [0, 1, 2], shard=1)
    load = store.kv.begin_load(fid, ALICE, tokens, 0, len(tokens) - 1)
    assert load is not None and load.n_tokens >= 8
    got = store.kv.loads.wait_loaded(load.load_id, 0.0, release=True, shard=0)
    assert all(p is not None for p in got)
    assert store.kv.stats()["leases"] == 1
    store.kv.loads.release(load.load_id, shard=0)  # a repeated release by the same rank counts once
    assert store.kv.stats()["leases"] == 1
    store.kv.loads.release(load.load_id, shard=1)
    assert store.kv.stats()["leases"] == 0


def test_a_parallel_engines_pages_load_from_disk_after_a_restart(tmp_path: Path) -> None:
    # Found by the model matrix: after a whole restart a TP=2 engine's async loads from the disk
    # tier failed ("5 of 5 pages could not be had") on both ranks.
    s = open_store(tmp_path / "data")
    fid = s.fingerprints.register(TP_FP)
    tokens = np.arange(1, 13, dtype=np.int32)
    plan = s.kv.plan_save(fid, ALICE, tokens, 3)
    _fill(s, [p.slot for p in plan.pages], 5)
    s.kv.saves.commit_save(plan.save_id, [0, 1, 2], shard=0)
    s.kv.saves.commit_save(plan.save_id, [0, 1, 2], shard=1)
    s.close()
    s = open_store(tmp_path / "data")
    try:
        load = s.kv.begin_load(fid, ALICE, tokens, 0, len(tokens) - 1)
        assert load is not None and load.is_async and load.n_tokens >= 8
        # Both ranks wait at once (each engine rank's loader thread), through the RPC.
        from concurrent.futures import ThreadPoolExecutor

        from dss.rpc import StoreClient

        address, authkey = s.serve_rpc()
        clients = [StoreClient(address, authkey, timeout_s=10.0) for _ in (0, 1)]
        with ThreadPoolExecutor(2) as pool:
            waits = list(pool.map(lambda c: c.wait_loaded(load.load_id, 10.0), clients))
        for got in waits:
            assert all(p is not None for p in got), got
        for c in clients:
            c.close()
        for shard in (0, 1):
            got = s.kv.loads.wait_loaded(load.load_id, 0.0, release=True, shard=shard)
            assert all(p is not None for p in got), got
            assert (s.pages.host.slot_array(got[0].slot) == 5).all()  # type: ignore[union-attr,arg-type]
        assert s.kv.stats()["leases"] == 0
    finally:
        s.close()
