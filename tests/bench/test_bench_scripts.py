"""Every benchmark keeps a smoke mode the suite runs, so a benchmark that breaks fails CI.

The store, trie and API benchmarks without an engine run here as `python bench/X.py --smoke`
(tiny sizes, seconds), as a person runs them; each must exit 0 and end with a `RESULT key=value
...` line that parses. The engine benchmarks' smoke modes share one engine in
tests/bench/test_bench_smoke.py; the model matrix's smoke rows are
tests/engine_patch/connector/test_model_matrix.py.
`test_every_bench_is_smoked` fails when a script is in none of these lists: a new benchmark
brings its smoke mode, or says here why it cannot have one in the suite.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time

import pytest

from tests.paths import BENCH, REPO

# Scripts whose `--smoke` run takes seconds and needs no engine (measured on 2 busy cores: 1-35 s each).
SMOKED_HERE = (
    "auth_flood",
    "branches",
    "dialogue_commits",
    "erase",
    "gpu_hot_load",
    "history_memory",
    "remote_read",
    "retention",
    "rollback_contention",
    "store_concurrency",
    "tiers",
    "trie",
    "verify",
)
# Engine benchmarks whose smoke modes run in tests/bench/test_bench_smoke.py (one shared engine).
SMOKED_WITH_ONE_ENGINE = (
    "engine_exactness",
    "engine_hot",
    "engine_restart",
    "engine_rollback",
    "swa_capacity",
)
SMOKED_ELSEWHERE = {
    "cluster": "tests/bench/test_cluster_smoke.py runs its --smoke (three servers behind HAProxy)",
    "model_matrix": "tests/engine_patch/connector/test_model_matrix.py runs its SMOKE_ROWS",
    "volatile": "tests/bench/test_volatile_smoke.py runs its --smoke against a server of its own",
}
# Benchmarks that start several engines or servers of their own: minutes even at their smallest,
# more than the suite's budget on 2 cores. What the suite runs of each instead:
NOT_IN_THE_SUITE = {
    "api_load": "a server under load for a minute; tests/bench/test_bench_api_load.py runs its reporting",
    "block_size": "one engine per block size (4 engine starts)",
    "cold_concurrent": "three servers up at once and rounds of cold prompts (`--quick`: minutes)",
    "engine_multiround": "three or four differently configured engines at once",
    "peers": "four servers (vLLM's, LMCache's) one after another",
    "reuse": "a server and several multi-turn sessions (`--quick`: 2 x 3 turns)",
    "schemathesis_stateful": "a fuzzing campaign against a served engine",
    "served_dtype": "one engine per dtype (3 engine starts)",
    "turn_path": "an in-process app with its own engine start; run by hand to count a turn's modules",
    "soak": "minutes of traffic with kills; tests/bench/test_soak.py runs 40 s of it (bench/_soak/)",
    "warm": "a server and multi-turn sessions",
}

RESULT_FIELD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)")


def parse_result(line: str) -> dict[str, str]:
    """`RESULT a=1 b=x ...` as a dict; raises on anything else."""
    head, _, rest = line.partition(" ")
    assert head == "RESULT" and rest, line
    fields = rest.split()
    parsed = dict(m.groups() for f in fields if (m := RESULT_FIELD.fullmatch(f)))
    assert len(parsed) == len(fields), f"not key=value: {line}"
    return parsed


def test_parse_result() -> None:
    assert parse_result("RESULT a=1.5 b_c=x:1") == {"a": "1.5", "b_c": "x:1"}
    for bad in ("RESULT", "RESULTS a=1", "RESULT a=1 b", "RESULT =1"):
        with pytest.raises(AssertionError):
            parse_result(bad)


def test_every_bench_is_smoked() -> None:
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    listed = [*SMOKED_HERE, *SMOKED_WITH_ONE_ENGINE, *SMOKED_ELSEWHERE, *NOT_IN_THE_SUITE]
    assert len(listed) == len(set(listed)), "a script listed twice"
    assert scripts == set(listed), (
        f"not listed: {sorted(scripts - set(listed))}; listed but gone: {sorted(set(listed) - scripts)}"
    )
    smoke_test = (REPO / "tests" / "bench" / "test_bench_smoke.py").read_text()
    for name in SMOKED_WITH_ONE_ENGINE:
        assert f'bench("{name}")' in smoke_test, f"{name} is not run in tests/bench/test_bench_smoke.py"


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOKED_HERE)
def test_bench_smoke_run(name: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(f"{name} --smoke: {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [parse_result(line) for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert results, f"no RESULT line:\n{proc.stdout[-3000:]}"
    for result in results:
        for key, value in result.items():
            try:
                number = float(value)
            except ValueError:
                continue  # a label (auth_flood's phase and statuses)
            assert math.isfinite(number), f"{name}: {key}={value}"
