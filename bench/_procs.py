"""Starting servers, for the benchmarks and the tests alike (tests/api_server.py,
tests/vllm_openai_server.py and bench/_soak/server.py build on it): the prepared model, a free
loopback port, the `dss serve` command line, and a child that dies with the process that started
it."""

from __future__ import annotations

import ctypes
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


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """In a child before exec (`preexec_fn`): `signum` reaches it when the thread that started it
    ends, however it ends (a killed test run or benchmark must not leave a server and its engine
    behind). SIGTERM lets a server flush its store; `die_hard_with_parent` is SIGKILL."""
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signum)


def die_hard_with_parent() -> None:
    """`die_with_parent` with SIGKILL (the soak's and the peers' servers: no graceful path)."""
    die_with_parent(signal.SIGKILL)


def serve_command(
    model: Path | None,
    data_dir: Path,
    port: int,
    *,
    cli: list[str] | None = None,
    dev: bool = False,
    log_level: str = "warning",
) -> list[str]:
    """`dss serve` on loopback: `model` None is `--no-engine`; `cli` the command that runs the
    CLI (default: this interpreter's `-m api.cli`)."""
    engine = ["--model", str(model)] if model is not None else ["--no-engine"]
    return [
        *(cli or [sys.executable, "-m", "api.cli"]), "serve", *engine,
        "--data-dir", str(data_dir),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--log-level", log_level,
        *(["--dev"] if dev else []),
    ]  # fmt: skip
