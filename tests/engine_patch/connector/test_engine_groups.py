"""KV cache groups (hybrid models) without an engine: the fingerprint, which pages are complete,
and per-group copies that leave other groups' layers and null blocks alone."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from dss.namespace import ModelFingerprint
from engine_patch.connector.copy import KVBlocks
from engine_patch.connector.groups import (
    NULL_BLOCK,
    KVGroup,
    KVGroups,
    UnsupportedGroups,
    complete_prefix,
    group_runs,
)
from engine_patch.connector.layouts import VLLM_AXES, KVLayout

FP = ModelFingerprint(
    model_id="m", revision="r", dtype="float32", num_layers=4, num_kv_heads=2, head_size=8, block_size=4
)


def test_a_single_group_engine_keeps_its_fingerprint_id() -> None:
    # The id every existing page is stored under: the fields before `kv_groups` existed.
    old = {
        k: v for k, v in asdict(FP).items() if k not in ("kv_groups", "tp_size", "pp_size", "kv_cache_dtype")
    }
    canon = json.dumps(old, sort_keys=True, separators=(",", ":"))
    assert FP.id == hashlib.blake2b(canon.encode(), digest_size=16).hexdigest()
    hybrid = ModelFingerprint(**{**asdict(FP), "kv_groups": "sliding64:0,2;full:1,3"})
    assert hybrid.id != FP.id
    assert ModelFingerprint.from_json(hybrid.to_json()) == hybrid


def test_groups_describe_and_parse() -> None:
    groups = KVGroups((KVGroup((0, 2), 64), KVGroup((1, 3))))
    assert groups.describe() == "sliding64:0,2;full:1,3"
    assert KVGroups.parse(groups.describe(), 4) == groups
    assert KVGroups.single(4).describe() == ""
    assert KVGroups.parse("", 4) == KVGroups.single(4)
    assert KVGroups((KVGroup((0, 1, 2, 3), 4096),)).describe() == "sliding4096:0,1,2,3"  # one SWA group


def test_skipped_tokens_follow_vllm() -> None:
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    group = KVGroup((0,), 64)
    manager = SimpleNamespace(sliding_window=64, extra_retained_tokens=0)
    for n in (0, 1, 63, 64, 65, 200, 4096):
        assert group.skipped_tokens(n) == SlidingWindowManager.get_num_skipped_tokens(manager, n)  # type: ignore[arg-type]
    assert KVGroup((0,)).skipped_tokens(4096) == 0


def test_a_page_is_complete_only_with_every_groups_block() -> None:
    window, full = [NULL_BLOCK, NULL_BLOCK, 7, 8], [3, 4, 5, 6]
    assert complete_prefix((window, full), (2, 3)) == 2
    assert complete_prefix((window, full), (1, 2, 3)) == 0
    assert complete_prefix((full,), (0, 1, 2, 3)) == 4
    assert complete_prefix((window, full), (3, 4)) == 1  # past the request's blocks


def test_groups_of_a_state_space_model_are_refused_by_name() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    attn = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    mamba = MambaSpec(block_size=16, shapes=((4, 4),), dtypes=(torch.float32,))

    def config(*specs: object) -> SimpleNamespace:
        groups = [
            SimpleNamespace(layer_names=[f"model.layers.{i}.attn"], kv_cache_spec=s)
            for i, s in enumerate(specs)
        ]
        return SimpleNamespace(kv_cache_groups=groups)

    def index(name: str) -> int:
        return int(name.split(".")[2])

    hybrid = KVGroups.of(
        config(SlidingWindowSpec(**attn, sliding_window=32), FullAttentionSpec(**attn)), index
    )  # type: ignore[arg-type]
    assert hybrid.describe() == "sliding32:0;full:1"
    with pytest.raises(UnsupportedGroups, match="state-space"):
        KVGroups.of(config(FullAttentionSpec(**attn), mamba), index)  # type: ignore[arg-type]


def test_each_group_copies_its_own_layers_and_skips_null_blocks() -> None:
    groups = KVGroups.parse("sliding64:0,2;full:1,3", 4)
    layers = [torch.zeros(10, 2, 4, 16) for _ in range(4)]
    blocks = KVBlocks(layers, KVLayout(VLLM_AXES, 10, packed=True))  # the CPU backend's blocks
    pages = torch.randn(3, 4, blocks.layer_block_nbytes // 4).view(torch.uint8)  # float32 bytes, no NaN
    # Two pages in slots 1 and 2: the window group holds no block for the first (null), block 7
    # for the second; the full group holds blocks 3 and 4.
    for layer_ids, run_list in group_runs(groups, ((NULL_BLOCK, 7), (3, 4)), (1, 2)):
        blocks.load(pages, run_list, layer_ids)

    def slot(s: int, layer: int) -> torch.Tensor:
        return pages[s, layer].view(torch.float32).view(2, 4, 16)

    for layer in (0, 2):
        assert torch.equal(layers[layer][7], slot(2, layer))
        assert (
            not layers[layer][NULL_BLOCK].any() and not layers[layer][3].any() and not layers[layer][4].any()
        )
    for layer in (1, 3):
        assert torch.equal(layers[layer][3], slot(1, layer)) and torch.equal(layers[layer][4], slot(2, layer))
        assert not layers[layer][7].any()
    # And back: a save of the same blocks gives the slots' bytes.
    out = torch.zeros_like(pages)
    for layer_ids, run_list in group_runs(groups, ((5, 7), (3, 4)), (1, 2)):
        if layer_ids == (0, 2):
            layers[0][5].copy_(slot(1, 0))
            layers[2][5].copy_(slot(1, 2))
        blocks.save(out, run_list, layer_ids)
    assert torch.equal(out[1:], pages[1:])


def test_the_api_finds_a_sliding_window_models_fingerprint_among_the_registered() -> None:
    # The API process cannot form vLLM's groups; it takes what the engine's connector registered.
    from engine_patch.connector.fingerprint import registered_for_model

    def config(cache_dtype: str) -> Any:
        return SimpleNamespace(
            model_config=SimpleNamespace(model="org/m", revision=None, dtype=torch.float32),
            cache_config=SimpleNamespace(cache_dtype=cache_dtype, calculate_kv_scales=False),
        )

    base = {**asdict(FP), "revision": "hub:main"}
    hybrid = ModelFingerprint(**{**base, "kv_groups": "sliding64:0,2;full:1,3"})
    other = ModelFingerprint(**{**base, "model_id": "n", "kv_groups": "sliding64:0,2;full:1,3"})
    single = ModelFingerprint(**base)
    e4m3, e5m2 = (
        ModelFingerprint(**{**asdict(hybrid), "dtype": "uint8", "kv_cache_dtype": f})
        for f in ("fp8_e4m3", "fp8_e5m2")
    )
    known = [single, other, hybrid, e4m3, e5m2]
    assert registered_for_model(config("auto"), known) == [hybrid]
    assert registered_for_model(config("fp8"), known) == [e4m3]  # vLLM's "fp8" is e4m3
    assert registered_for_model(config("fp8_e5m2"), known) == [e5m2]


def test_a_hybrid_models_load_from_the_host_tier_is_done_in_the_step_it_starts(tmp_path: Path) -> None:
    """A hybrid model's loads are asynchronous to vLLM (a failure is only reportable for a whole
    request), but pages already in the host arena need no wait: the worker copies them in
    `start_load_kv` and the same step's `get_finished` reports the request done, so it runs in
    the next engine step. Before, every such load went to the loader thread, which first asked
    the store for slots the plan had already named: a thread hand-off and at least one more
    engine step (hot loads at 5-9x vLLM's prefix cache, issue 31)."""
    from dss.rpc import StoreClient
    from dss.wire import span_of
    from engine_patch.connector.metadata import DSSConnectorMetadata, LoadSpec
    from engine_patch.connector.worker_side import WorkerSide
    from tests.engine_helpers import wait_until
    from tests.store_helpers import SMALL_FP, open_store, pages_for, put_sequence

    fp = replace(SMALL_FP, kv_groups=f"sliding{2 * SMALL_FP.block_size}:0;full:1")
    store = open_store(tmp_path / "data", shm_dir=tmp_path / "shm", write_through=False)
    fid = store.fingerprints.register(fp)
    address, authkey = store.serve_rpc()
    n_blocks = 8
    worker = WorkerSide(fp, lambda: StoreClient(address, authkey), n_blocks)
    shape = (n_blocks, fp.num_kv_heads, fp.block_size, 2 * fp.head_size)
    layers = {f"layer.{i}": torch.zeros(shape, dtype=torch.bfloat16) for i in range(fp.num_layers)}
    worker.register_kv_caches(layers, lambda name: int(name.rsplit(".", 1)[1]))
    tenant = store.identity.tenant_for("alice")
    tokens = np.arange(1, 1 + 2 * fp.block_size + 1, dtype=np.int32)  # two whole pages, one more token
    pages = pages_for(fp, tokens)
    try:
        assert worker.ready
        put_sequence(store, fid, tenant, tokens[: 2 * fp.block_size], pages)
        plan = store.kv.begin_load(fid, tenant, tokens)
        assert plan is not None and not plan.is_async  # every page in the host arena
        span = span_of(plan.pages)
        assert span is not None
        # Group 0 (the window layer) holds blocks 5 and 6, group 1 (full) blocks 2 and 3.
        spec = LoadSpec("req-h", plan.load_id, ((5, 6), (2, 3)), span, is_async=True)
        worker.start_load_kv(DSSConnectorMetadata(loads=[spec]))
        assert worker.get_finished(set()) == (None, {"req-h"})
        page_layer = fp.layer_block_nbytes
        for i, block in enumerate((5, 6)):
            assert layers["layer.0"][block].view(torch.uint8).numpy().tobytes() == pages[i][:page_layer]
        for i, block in enumerate((2, 3)):
            assert layers["layer.1"][block].view(torch.uint8).numpy().tobytes() == pages[i][page_layer:]
        assert worker.get_block_ids_with_load_errors() == set()
        # Checked by the slots' generations; the lease ended by the releasing thread, soon.
        assert wait_until(lambda: store.kv.loads.count() == 0, timeout_s=5.0)
        store.check()
    finally:
        worker.shutdown()
        store.close()
