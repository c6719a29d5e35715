"""bench/volatile.py in its smoke mode (2 dialogues x 3 turns against one `dss serve`): lead
updates over HTTP still run end to end, its RESULT line parses and a later turn of a drifting
system prompt gets most of its prompt from cache, as a fixed one does."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from tests.api_server import model_dir
from tests.bench.test_bench_scripts import parse_result
from tests.paths import BENCH, REPO

pytestmark = [pytest.mark.engine, pytest.mark.slow]

KEYS = (
    "later_cached_share",
    "exact_cached_share",
    "ttft_vs_exact",
    "top1_agreement",
    "top1_agreement_floor",
    "value_followed",
    "value_followed_exact",
)


def test_volatile_smoke() -> None:
    if model_dir() is None:
        pytest.skip("the default model is not prepared (run `make model` or set DSS_MODEL_DIR)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(BENCH / "volatile.py"), "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(f"volatile --smoke: {time.monotonic() - t0:.0f} s\n{proc.stdout[-2500:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("RESULT "), f"the last line is not RESULT:\n{proc.stdout[-3000:]}"
    result = parse_result(lines[-1])
    assert set(KEYS) <= set(result), result
    later, exact = float(result["later_cached_share"]), float(result["exact_cached_share"])
    assert later > 0.5 and exact > 0.5, result
    assert math.isfinite(float(result["ttft_vs_exact"])), result
