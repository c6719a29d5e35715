"""vLLM's own OpenAI-compatible server on the DSS model folder, as the reference the parity tests
compare `dss serve` with.

`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script is broken on the CPU
wheel) in its own process group on a free loopback port, configured as DSS configures its engine:
the served dtype (`engine_patch.setup.factory.served_dtype`: bfloat16 where native), eager mode, seed
0, the test servers'
`max_model_len` and KV cache size, the same served model name, and
`--enable-prompt-tokens-details` so that `usage` has the shape DSS gives it. vLLM spawns its
engine processes into that group; `stop()` terminates the whole group and kills what is
left, and the server also dies with the test process (PR_SET_PDEATHSIG), so nothing outlives a
test run however it ends.

`DSS_TEST_VLLM_URL` points the tests at a vLLM server that is already running instead (to iterate
on the tests without paying the start-up each time); it must be configured as `command()` says.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench._procs import die_with_parent, free_port
from engine_patch.setup.factory import served_dtype

# DSS's served dtype, so that both servers compute the same way.
SERVED_DTYPE = served_dtype()
START_TIMEOUT_S = 420.0  # ~115 s measured on 2 loaded cores in eager mode; compiled mode takes ~200 s
STOP_TIMEOUT_S = 30.0


class VllmOpenAIServer:
    def __init__(self, model: Path, log_path: Path, *, served_name: str, max_model_len: int = 2048) -> None:
        self.model = model
        self.log_path = log_path
        self.served_name = served_name
        self.max_model_len = max_model_len
        external = os.environ.get("DSS_TEST_VLLM_URL")
        self.external = bool(external)
        self.port = 0 if external else free_port()
        self.base_url = (external or f"http://127.0.0.1:{self.port}").rstrip("/")
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_after_s: float | None = None
        self._launched_at = 0.0

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", self.served_name,
            "--dtype", SERVED_DTYPE,
            "--enforce-eager",
            "--seed", "0",
            "--max-model-len", str(self.max_model_len),
            "--enable-prompt-tokens-details",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--uvicorn-log-level", "warning",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip

    def launch(self) -> None:
        """Start the process and return at once (`wait_ready` waits for it)."""
        if self.external or self.proc is not None:
            return
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the subprocess
        try:
            self.proc = subprocess.Popen(
                self.command(),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: the engine processes join it
                preexec_fn=die_with_parent,
            )
        finally:
            log.close()
        self._launched_at = time.monotonic()
        atexit.register(self.stop)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait for `/health` to answer 200; on a timeout or an early exit, stop and raise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise RuntimeError(f"vLLM's server exited ({code}) during start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    self.ready_after_s = time.monotonic() - self._launched_at if self.proc else 0.0
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vLLM's server was not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL to whatever is left of it after a grace period."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the leader's pid is the group id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_TIMEOUT_S)
        # The engine processes may outlive the API process: whatever is left of the group goes.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            time.sleep(0.2)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def openai(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", timeout=180.0, max_retries=0)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
