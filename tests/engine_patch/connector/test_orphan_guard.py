"""An engine core whose server was SIGKILLed ends itself (`engine_patch.connector.orphan_guard`).

A stand-in for the engine core: a `multiprocessing` (spawn) child that starts the guard, spawned
by a parent process that the test kills with SIGKILL. The real engine is checked in
tests/deploy/test_cluster.py (`kill -9` of a server leaves none of its engine processes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from engine_patch.connector.orphan_guard import guard_against_orphaning
from tests.paths import REPO

PARENT = """
import multiprocessing, sys, time

def child(guarded):
    if guarded:
        from engine_patch.connector.orphan_guard import guard_against_orphaning
        assert guard_against_orphaning(poll_s=0.05)
    time.sleep(60)

if __name__ == "__main__":
    p = multiprocessing.get_context("spawn").Process(target=child, args=(sys.argv[1] == "1",))
    p.start()
    print(p.pid, flush=True)
    time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (dead, not yet reaped by its new parent) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def orphan_lives(guarded: bool, tmp_path: Path) -> bool:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen(
        [sys.executable, str(script), "1" if guarded else "0"], stdout=subprocess.PIPE, env=env
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        time.sleep(1.0)  # the child imports and starts its guard
        assert alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        return alive(child)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_guarded_child_ends_when_its_parent_is_killed(tmp_path: Path) -> None:
    assert not orphan_lives(True, tmp_path)


def test_an_unguarded_child_outlives_its_parent(tmp_path: Path) -> None:
    """What the guard is for: without it the child stays (as vLLM's engine core did)."""
    assert orphan_lives(False, tmp_path)


def test_the_process_that_built_the_engine_is_not_guarded() -> None:
    assert guard_against_orphaning() is False  # pytest's main process: no parent to watch
