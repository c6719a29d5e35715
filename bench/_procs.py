"""Process helpers shared by the benchmarks that start servers: the prepared model, a free
loopback port, and a child that dies with the benchmark."""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's engine_patch, not another one's editable install


def model_dir() -> Path:
    """The model every bench serves: `engine_patch.setup.model.find_model` (the CLI's and the
    tests' way too), or an exit that says how to prepare it."""
    from engine_patch.setup.model import NOT_PREPARED, find_model

    found = find_model()
    if found is None:
        raise SystemExit(NOT_PREPARED)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """In a server before exec: SIGKILL it when the benchmark dies, however it dies."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
