"""Process helpers shared by the benchmarks that start servers: the prepared model, a free
loopback port, and a child that dies with the benchmark."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def model_dir() -> Path:
    env = os.environ.get("DSS_MODEL_DIR")
    candidates = [Path(env)] if env else []
    candidates += [
        Path.home() / ".cache" / "dss" / "models" / "SmolLM2-135M-Instruct",
        REPO / ".dss" / "models" / "SmolLM2-135M-Instruct",
    ]
    for c in candidates:
        if (c / "config.json").is_file() and (c / ".dss-ready").is_file():
            return c
    raise SystemExit("the default model is not prepared: run `make model` (or set DSS_MODEL_DIR)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """In a server before exec: SIGKILL it when the benchmark dies, however it dies."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
