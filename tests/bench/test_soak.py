"""A short soak (`bench/soak.py`): the real server under mixed traffic on every route from a few
clients (chat, `n` alternatives, `/messages`, Responses, session and version routes, hints,
warm-ups, prefixes) and from end users of a frontend key (sessions, conversations, responses in
them), while an operator erases the users under them and the frontend its end users, SIGKILLed
once and restarted on its data directory; every acknowledged version must survive unless its
user was erased after it was sent, nothing may hang or answer 5xx, no answer may differ from a
cold recompute beyond rounding, no page may fail its checksum, erased users and end users must
leave nothing behind, and no end user may see another's.

About two minutes on two cores (two server starts of ~25-45 s and 40 s of traffic).
The long campaign is the same script with `--duration-s 1200 --kill-every-s 180`
(docs/operations.md, "Soak and fault campaign").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api_server import model_dir
from tests.paths import REPO

pytestmark = [pytest.mark.engine, pytest.mark.slow]

RESULT_KEYS = ["requests", "hangs", "errors_5xx", "lost_versions", "corrupt_served", "remnants", "restarts"]
MUST_BE_ZERO = ("hangs", "errors_5xx", "lost_versions", "corrupt_served", "remnants")
DETAIL_ZERO = (
    "unexpected",
    "restart_failures",
    "remnants_at_erasure",
    "pre_erasure_kept",
    "leftovers",
    "end_user_remnants",
    "end_user_pre_erasure_kept",
    "end_user_leaks",
    "end_user_lost",
)


def parse_line(out: str, tag: str) -> dict[str, str]:
    lines = [ln for ln in out.splitlines() if ln.startswith(tag + " ")]
    assert lines, out[-6000:]
    return dict(kv.split("=", 1) for kv in lines[-1].split()[1:])


def traffic_floor(out: str, clients: int, duration_s: float) -> int:
    """The acknowledged versions a soak must reach: half of what `clients` can do in
    `duration_s` at the chat p50 it printed (`latency chat: n=… p50=… s`), between 2 and 10: at a
    p50 of 36 s (float32 on 2 AVX2 cores, its restart and erasures in the same 40 s) a soak acked
    2, all verified (a fresh-clone CI run on such a machine, 2026-12-05)."""
    p50 = [float(m) for m in re.findall(r"^latency chat: n=\d+ p50=([0-9.]+)", out, re.M)]
    possible = clients * duration_s / p50[-1] if p50 and p50[-1] > 0 else 20.0
    return max(2, min(10, int(possible / 2)))


def test_short_soak_with_one_kill(tmp_path: Path) -> None:
    model = model_dir()
    if model is None:
        pytest.skip("the default model is not prepared (run `make model` or set DSS_MODEL_DIR)")
    cmd = [
        sys.executable, str(REPO / "bench" / "soak.py"),
        "--duration-s", "40",
        "--kill-every-s", "20",
        "--max-kills", "1",
        "--clients", "3",
        "--erase-weight", "1",
        "--race-erase-every-s", "15",
        "--seed", "7",
        "--out", str(tmp_path / "soak"),
    ]  # fmt: skip
    env = {**os.environ, "DSS_MODEL_DIR": str(model)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    assert proc.stdout.rstrip().splitlines()[-1].startswith("RESULT "), out[-3000:]  # the last line
    result, detail = parse_line(out, "RESULT"), parse_line(out, "DETAIL")
    print(out[out.rfind("DETAIL ") :])  # shown with `pytest -s` / `-rP`
    assert list(result) == RESULT_KEYS, result
    assert {k: result[k] for k in MUST_BE_ZERO} == dict.fromkeys(MUST_BE_ZERO, "0"), out[-6000:]
    assert {k: detail[k] for k in DETAIL_ZERO} == dict.fromkeys(DETAIL_ZERO, "0"), out[-6000:]
    assert result["restarts"] == "1", out[-6000:]
    # Enough traffic to mean something, not a speed target (the zero counts above are what the
    # soak is for). What 3 clients can ack in 40 s depends on the machine's turn time: a slow CI
    # machine acked 18 in 60 s with a chat p50 of 8 s; a 2-core AMD EPYC with AVX2 only (the
    # engine computes in float32 there) had a chat p50 of 31 s and acked 4. So at least half of
    # what the measured p50 allows, between 3 and 10.
    floor = traffic_floor(out, clients=3, duration_s=40)
    assert int(detail["acked_versions"]) >= floor, (floor, out[-6000:])
    # checked after the restart and at the end
    assert int(detail["verified_versions"]) >= min(5, floor), (floor, out[-6000:])
    assert int(detail["erasures"]) >= 1 and int(detail["race_erasures"]) >= 1, out[-6000:]
    # The frontend's end users: written to, erased through the frontend key while a write ran.
    # (3 on every machine so far, also at a 36 s chat p50: the same floor's scale keeps a margin)
    assert int(detail["end_user_acked"]) >= min(3, floor), out[-6000:]
    assert int(detail["end_user_erasures"]) >= 1, out[-6000:]
    assert proc.returncode == 0, out[-6000:]
