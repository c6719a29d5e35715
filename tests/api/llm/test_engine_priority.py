"""The engine's processes run behind the API's on the CPU (`api.llm.engine_priority`): every
thread of the engine in Linux's SCHED_IDLE class, the API's threads and the store's own helper
processes as they were."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest

from api.llm.engine_priority import child_pids, lower_engine_priority
from tests.api_server import ApiServer, api_server  # noqa: F401 - a fixture

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")


def _classes(proc: psutil.Process) -> set[int]:
    return {os.sched_getscheduler(t.id) for t in proc.threads()}


@contextmanager
def two_threaded_child() -> Iterator[psutil.Process]:
    """A child process with a second thread running, like an engine's."""
    code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"
    popen = subprocess.Popen([sys.executable, "-c", code])
    try:
        proc = psutil.Process(popen.pid)
        deadline = time.monotonic() + 30
        while len(proc.threads()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        yield proc
    finally:
        popen.kill()
        popen.wait()


@pytest.fixture
def sleeper() -> Iterator[psutil.Process]:
    """A child started before the engine."""
    with two_threaded_child() as proc:
        yield proc


def test_only_the_processes_started_since_are_put_in_the_idle_class(sleeper: psutil.Process) -> None:
    before = child_pids()
    assert sleeper.pid in before
    with two_threaded_child() as engine:
        lower_engine_priority(before, "idle", nice=10)
        assert _classes(engine) == {os.SCHED_IDLE}
    assert _classes(sleeper) == {os.SCHED_OTHER}
    assert _classes(psutil.Process()) == {os.SCHED_OTHER}


def test_nice_leaves_the_class_and_sets_the_nice_value(sleeper: psutil.Process) -> None:
    lower_engine_priority(child_pids() - {sleeper.pid}, "nice", nice=7)
    assert _classes(sleeper) == {os.SCHED_OTHER}
    assert {os.getpriority(os.PRIO_PROCESS, t.id) for t in sleeper.threads()} == {7}


def test_a_served_engine_runs_in_the_idle_class_and_the_api_does_not(api_server: ApiServer) -> None:  # noqa: F811
    assert api_server.proc is not None
    server = psutil.Process(api_server.proc.pid)
    engine = [p for p in server.children(recursive=True) if p.name().startswith("VLLM")]
    assert engine, "no engine process found"
    for proc in engine:
        assert _classes(proc) == {os.SCHED_IDLE}, proc.name()
    assert os.SCHED_IDLE not in _classes(server)
