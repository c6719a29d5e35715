"""The engine benchmarks in their smoke modes (tiny sizes), so a benchmark that breaks fails CI.

Each benchmark's `run(...)` is what its `main()` runs; here they share one store and one engine
(an engine start costs more than a smoke run): hot hit, rollback and exactness on it, then the
restart benchmark takes it over as its engine A, shuts it down and starts its own two. The
engines run in this process (`deterministic_batches`: ~3-6 s a start instead of ~25-30 s). Every
benchmark checks its own loads exactly (tail pages included) and raises on a wrong one; here its
RESULT values must also be finite numbers, and exactness's hard counts zero.
`bench/engine_multiround.py` needs three differently configured engines and is left to `bench/`;
`bench/swa_capacity.py` starts its own two (a tiny sliding-window model), last.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.paths import BENCH

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def bench(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


class Rig:
    def __init__(self) -> None:
        common = bench("_engine_common")
        common.pin_cpu_reservation()
        self.served = common.ServedStore(host_gib=1.0)
        # In this process (seconds to start instead of ~30 s); the benchmarks' own runs serve
        # from engines in processes of their own.
        self.engine: Any = common.TimedEngine(
            self.served.address, self.served.authkey, enable_prefix_caching=True, deterministic_batches=True
        )

    def take_engine(self) -> Any:
        engine, self.engine = self.engine, None
        return engine

    def close(self) -> None:
        try:
            if self.engine is not None:
                self.engine.close()
        finally:
            self.served.close()


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        r.close()


def finite(result: dict[str, Any]) -> None:
    bench("_engine_common").print_result(**result)  # raises on a value that is not finite


def test_hot_smoke(rig: Rig) -> None:
    t0 = time.monotonic()
    finite(bench("engine_hot").run(rig.served, rig.engine, smoke=True))
    print(f"engine_hot smoke: {time.monotonic() - t0:.0f} s")


def test_rollback_smoke(rig: Rig) -> None:
    t0 = time.monotonic()
    finite(bench("engine_rollback").run(rig.served, rig.engine, smoke=True))
    print(f"engine_rollback smoke: {time.monotonic() - t0:.0f} s")


def test_exactness_smoke(rig: Rig) -> None:
    t0 = time.monotonic()
    result = bench("engine_exactness").run(rig.served, rig.engine, rig.engine, smoke=True)
    finite(result)
    print(f"engine_exactness smoke: {time.monotonic() - t0:.0f} s")
    assert result["turns"] > 0 and result["tail_turns"] > 0
    assert result["load_misses"] == 0 and result["dss_apc_mismatches"] == 0, result


def test_restart_smoke(rig: Rig) -> None:
    """Last: it reopens the store and shuts the shared engine down."""
    t0 = time.monotonic()
    finite(bench("engine_restart").run(rig.served, rig.take_engine(), smoke=True, in_process=True))
    print(f"engine_restart smoke: {time.monotonic() - t0:.0f} s")


def test_swa_capacity_smoke(tmp_path: Path) -> None:
    """Its own engines (a tiny sliding-window model, with and without DSS); after the shared one
    is shut down by the restart smoke."""
    from tests.engine_helpers import model_path
    from tests.tiny_models import tiny_gemma2

    t0 = time.monotonic()
    result = bench("swa_capacity").run(tiny_gemma2(tmp_path, model_path()), smoke=True)
    finite(result)
    print(f"swa_capacity smoke: {time.monotonic() - t0:.0f} s")
    assert result["swa_capacity_vs_vllm"] >= 0.95, result
