"""The model matrix's smallest rows (bench/model_matrix.py `SMOKE_ROWS`): DSS on tiny random-weight
models of other shapes and attention kinds than the default model's, each on a real vLLM engine.

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
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[1] / "bench"


def matrix() -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("model_matrix")


@pytest.mark.parametrize("row", matrix().SMOKE_ROWS, ids=lambda r: r.name)
def test_model_matrix_row(row: Any) -> None:
    m = matrix()
    res = m.run_row(row, quick=True)
    m.table([res])
    assert not res.unsupported, f"{row.name}: {res.unsupported}"
    assert not res.mismatches, "\n".join(res.mismatches)
    assert res.turns >= 10
    assert res.reuse >= 0.98, f"reuse {res.reuse:.3f}"
    if res.reference == "APC":
        assert res.exact_turns > 0, "no turn compared DSS with APC on the same KV"
        assert res.hot_vs_apc < 20, f"a hot load took {res.hot_vs_apc:.1f}x an APC hit"
