"""`bench/api_load.py` fails loudly, naming the operation, when a kind of operation never
completed, instead of printing `rollback_p99_ms=nan` (issue 20: in float32 not one rollback
completed under 32 clients and the RESULT line said `nan`). The load itself is replaced by a
recorded outcome; the real load runs in `bench/`."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import pytest

from tests.paths import BENCH


def api_load() -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("api_load")


def stats_with(mod: ModuleType, kinds: dict[str, int], cold: int = 1, warm: int = 1) -> object:
    stats = mod.Stats()
    for kind, n in kinds.items():
        stats.completed[kind] = n
        stats.latency[kind].extend([0.01] * n)
        stats.requests += n
    stats.ttft_cold.extend([0.5] * cold)
    stats.ttft_warm.extend([0.1] * warm)
    return stats


def test_degenerate_kinds_names_what_never_completed() -> None:
    mod = api_load()
    every = {"chat": 5, "rollback": 2, "branch": 1, "get_session": 1}
    assert stats_with(mod, every).degenerate_kinds() == []  # type: ignore[attr-defined]
    no_rollback = stats_with(mod, {**every, "rollback": 0})
    assert no_rollback.degenerate_kinds() == ["rollback"]  # type: ignore[attr-defined]
    assert stats_with(mod, every, warm=0).degenerate_kinds() == ["ttft_warm"]  # type: ignore[attr-defined]


def test_a_run_without_rollbacks_exits_naming_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mod = api_load()
    stats = stats_with(mod, {"chat": 3, "branch": 1, "get_session": 1, "create_session": 32})
    stats.errors["rollback:ReadTimeout"] = 7  # type: ignore[attr-defined]

    async def recorded_load(url: str, keys: list[str]) -> tuple[object, float]:
        return stats, 60.0

    monkeypatch.setattr(mod, "load", recorded_load)
    monkeypatch.setenv("DSS_BENCH_URL", "http://127.0.0.1:9")  # nothing is started or called
    monkeypatch.setenv("DSS_BENCH_KEYS", "k1,k2")
    with pytest.raises(SystemExit) as exit_:
        mod.main()
    message = str(exit_.value.code)
    assert message.startswith("the benchmark degenerated: no rollback completed in 60 s"), message
    assert "'rollback:ReadTimeout': 7" in message and "\n" not in message
    out = capsys.readouterr().out
    assert "RESULT" not in out and "nan" not in out
