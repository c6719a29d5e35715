"""KV cache groups (hybrid models) without an engine: the fingerprint, which pages are complete,
and per-group copies that leave other groups' layers and null blocks alone."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from types import SimpleNamespace

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
    old = {k: v for k, v in asdict(FP).items() if k not in ("kv_groups", "tp_size", "pp_size")}
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

    config = SimpleNamespace(model_config=SimpleNamespace(model="org/m", revision=None, dtype=torch.float32))
    base = {**asdict(FP), "revision": "hub:main"}
    hybrid = ModelFingerprint(**{**base, "kv_groups": "sliding64:0,2;full:1,3"})
    other = ModelFingerprint(**{**base, "model_id": "n", "kv_groups": "sliding64:0,2;full:1,3"})
    single = ModelFingerprint(**base)
    assert registered_for_model(config, [single, other, hybrid]) == [hybrid]  # type: ignore[arg-type]
