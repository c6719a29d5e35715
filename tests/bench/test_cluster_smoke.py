"""bench/cluster.py in its smoke mode: two real `dss serve` (engines on the default model) on one
PostgreSQL and one Redis, HAProxy in front (the shipped configuration), one session per phase and
per way of naming a session. Its RESULT line parses, nothing acknowledged is lost, and every way
of naming a session kept its turns on the server that holds it (`routed_to_holder=1`).
Skipped without the model, PostgreSQL or Redis (as tests/deploy/test_cluster.py)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import warnings

import pytest

from tests.api_server import model_dir
from tests.bench.test_bench_scripts import parse_result
from tests.dss.pages.test_tier_remote import REDIS_URL, _redis_answers
from tests.paths import BENCH, REPO

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.pg]

KEYS = (
    "cross_server_ttft_vs_cold",
    "failover_ttft_vs_cold",
    "remote_load_mbps",
    "redis_ceiling_mbps",
    "routed_to_holder",
    "lost",
    "lost_versions",
    "erase_fleet_s",
    "warmup_stalls",
)


def test_cluster_smoke(pg_url: str) -> None:
    if model_dir() is None:
        pytest.skip("the default model is not prepared (run `make model` or set DSS_MODEL_DIR)")
    if not _redis_answers(REDIS_URL):
        pytest.skip(f"no Redis answers at {REDIS_URL}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(BENCH / "cluster.py"), "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(f"cluster --smoke: {time.monotonic() - t0:.0f} s\n{proc.stdout[-2500:]}")
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-8000:]
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("RESULT "), f"the last line is not RESULT:\n{proc.stdout[-3000:]}"
    result = parse_result(lines[-1])
    assert set(KEYS) <= set(result), result
    assert all(math.isfinite(float(result[k])) for k in KEYS), result
    assert float(result["routed_to_holder"]) == 1.0, proc.stdout[-3000:]
    assert int(result["lost"]) == 0 and int(result["lost_versions"]) == 0, result
    if int(result["warmup_stalls"]):  # the bench sent the turn again, after printing the stall
        warnings.warn(f"a warm-up turn stalled: {proc.stdout[-20000:]}", stacklevel=1)
    assert float(result["remote_load_mbps"]) > 0 and float(result["redis_ceiling_mbps"]) > 0, result
