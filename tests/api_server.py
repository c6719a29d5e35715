"""The real DSS server for API tests: `dss serve` in a subprocess on a free loopback port.

One server per configuration and test session (a vLLM engine takes ~40 s to start): the API test
modules use the `api_server` fixture, which returns the same process-wide `ApiServer`, or
`small_api_server` (two generation slots, for admission tests); they are stopped when the test
process exits. The model comes from `DSS_MODEL_DIR`, else the default model prepared under
`<repo>/.dss` (`dss model pull`); without either, engine tests skip.

Keys are real: `server.key(user)` creates an API key for `user` directly in the server's
database (as `dss keys create` does), so requests are authenticated like in production.
`ApiServer(..., dev=True)` runs `dss serve --dev` instead, where `X-DSS-User` names the user.

The server listens before it is ready; `start()` waits for `/readyz` and keeps, in `start_trace`,
what `/healthz`, `/readyz` and a chat request answered meanwhile (the readiness tests read it).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench._procs import die_with_parent, free_port, serve_command
from engine_patch.setup.model import find_model
from tests.paths import REPO

__all__ = [
    "REPO",
    "Answer",
    "ApiServer",
    "cached_tokens",
    "die_with_parent",
    "free_port",
    "model_dir",
    "serve_command",
]

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
# Small enough that a fuzzer's max_tokens cannot keep the CPU engine busy for minutes.
MAX_OUTPUT_TOKENS = 512  # room for a stream long enough to be interrupted (tests ask for less)


def model_dir() -> Path | None:
    """The model the API tests serve, found as the CLI and the benches find it; None when none is
    prepared (the tests skip)."""
    return find_model()


@dataclass(frozen=True)
class Answer:
    """What one probe got while the server started: `status` None for no connection."""

    at_s: float
    probe: str  # "healthz", "readyz" or "chat"
    status: int | None
    body: dict[str, Any] | None = None
    retry_after: str | None = None


class ApiServer:
    def __init__(
        self,
        model: Path | None,
        root: Path,
        *,
        dev: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model = model  # None: `--no-engine`
        self.dev = dev
        self.extra_env = dict(env or {})
        self.start_trace: list[Answer] = []
        self.root = root
        self.data_dir = root / "data"
        self.log_path = root / "server.log"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._keys: dict[tuple[str, bool], str] = {}
        self.starts = 0

    # ------------------------------------------------------------------------------ lifecycle
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "DSS_ENGINE__MAX_MODEL_LEN": "2048",
                "DSS_ENGINE__KV_CACHE_SPACE_GIB": "1",
                "DSS_LIMITS__MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS),
                "DSS_LIMITS__DEFAULT_MAX_TOKENS": "32",
                "DSS_STORE__HOST_CAPACITY_BYTES": str(256 << 20),
                "DSS_STORE__DISK_CAPACITY_BYTES": str(2 << 30),
                "DSS_STORE__FSYNC": "false",
                "PYTHONUNBUFFERED": "1",
                **self.extra_env,
            }
        )
        return env

    def command(self) -> list[str]:
        return serve_command(self.model, self.data_dir, self.port, dev=self.dev)

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process without waiting for it (from the thread that outlives it: the child
        is signalled when the thread that started it ends). `wait_ready` waits."""
        if self.proc is not None:
            raise RuntimeError("the server is running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self._keys:
            self.key("admin", admin=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the subprocess
        self.proc = subprocess.Popen(
            self.command(),
            cwd=REPO,
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
        log.close()
        self.starts += 1
        self.start_trace = []

    def wait_ready(self) -> None:
        assert self.proc is not None, "launch() first"
        began = time.monotonic()
        deadline = began + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"the server exited during start-up:\n{self.log_tail()}")
            for probe in ("healthz", "readyz", "chat"):
                answer = self._probe(probe, time.monotonic() - began)
                last = next((a for a in reversed(self.start_trace) if a.probe == probe), None)
                if last is None or (last.status, last.body) != (answer.status, answer.body):
                    self.start_trace.append(answer)  # changes only: a start makes hundreds of probes
                if probe == "readyz" and answer.status == 200:
                    return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server was not ready after {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def _probe(self, probe: str, at_s: float) -> Answer:
        try:
            if probe == "chat":
                body = {"messages": [user_msg("hi")], "max_tokens": 1}
                r = httpx.post(
                    self.base_url + "/v1/chat/completions", json=body, headers=self.headers("admin", True),
                    timeout=5,
                )  # fmt: skip
            else:
                r = httpx.get(f"{self.base_url}/{probe}", timeout=2)
        except httpx.HTTPError:
            return Answer(at_s, probe, None)
        try:
            data = r.json()
        except ValueError:
            data = None
        if probe == "chat" and r.status_code == 200:
            data = None  # the answer's text and ids differ every time: only the status matters
        return Answer(at_s, probe, r.status_code, data, r.headers.get("retry-after"))

    def stop(self) -> int | None:
        """Graceful stop (SIGTERM): the store flushes and closes. Returns the exit code."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # ---------------------------------------------------------------------------------- clients
    def key(self, user: str, admin: bool = False) -> str:
        """An API key for `user` (created once, straight in the server's database)."""
        cached = self._keys.get((user, admin))
        if cached is not None:
            return cached
        from api.keys.api_keys import ApiKeys
        from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, upgrade_to_head

        # The server's database: its own SQLite file, or the fleet's PostgreSQL (several servers).
        url = self.extra_env.get("DSS_STORE__DB_URL") or sqlite_url_for(self.data_dir)
        upgrade_to_head(url)
        engine = make_engine(url)
        try:
            created = ApiKeys(make_session_factory(engine)).create(None if admin else user, admin=admin)
        finally:
            engine.dispose()
        self._keys[(user, admin)] = created.key
        return created.key

    @property
    def admin_key(self) -> str:
        return self.key("admin", admin=True)

    def headers(self, user: str, admin: bool = False) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key(user, admin)}"}

    def client(self, user: str, admin: bool = False, timeout: float = 180.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers(user, admin), timeout=timeout)

    def async_client(self, user: str, timeout: float = 300.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers(user), timeout=timeout)

    def openai(self, user: str) -> Any:
        import openai

        return openai.OpenAI(
            base_url=self.base_url + "/v1", api_key=self.key(user), timeout=180.0, max_retries=0
        )


# The configurations tests share, each started once per test process on first use.
VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    # Two generation slots: admission tests overrun them with a few requests. Its lead-update
    # quality gate checks every lead update and trips on any distance (the gate's test).
    "small": {
        "DSS_ENGINE__MAX_INFLIGHT": "2",
        "DSS_ENGINE__RETRY_AFTER_S": "3",
        "DSS_LEAD__GATE_SAMPLE": "1",
        "DSS_LEAD__GATE_MIN_CHECKS": "1",
        "DSS_LEAD__GATE_MAX_DISTANCE": "0",
        # A stream whose client stops reading is cut soon (tests/api/turn/test_admission.py).
        "DSS_SERVER__SEND_TIMEOUT_S": "2",
    },
}
# The default, started beside vLLM's own server (tests/api/shapes/test_vllm_parity.py).
VARIANTS["parity"] = {}
_SERVERS: dict[str, ApiServer] = {}
_FAILED: dict[str, str] = {}


def stop_servers(*variants: str) -> None:
    """Stop the shared servers of `variants` (every one when none is named); a later `get_server`
    starts a new one. Each holds a whole engine (about 3.5 GiB in float32): tests/conftest.py stops
    them once the tests that share them ran, before tests that start engines of their own."""
    for name in variants or list(_SERVERS):
        server = _SERVERS.pop(name, None)
        if server is not None:
            server.stop()
            shutil.rmtree(server.root, ignore_errors=True)


def get_server(variant: str = "default") -> ApiServer:
    """The process-wide server of `variant`, started on first use."""
    if variant in _FAILED:
        pytest.fail(_FAILED[variant])
    server = _SERVERS.get(variant)
    if server is None:
        model = model_dir()
        if model is None:
            pytest.skip("the default model is not prepared (run `make model` or set DSS_MODEL_DIR)")
        server = ApiServer(
            model, Path(tempfile.mkdtemp(prefix=f"dss-api-test-{variant}-")), env=VARIANTS[variant]
        )
        try:
            server.start()
        except RuntimeError as exc:
            _FAILED[variant] = str(exc)
            raise
        if not _SERVERS:
            atexit.register(stop_servers)
        _SERVERS[variant] = server
    if server.proc is None:
        server.start()
    return server


@pytest.fixture(scope="session")
def api_server() -> Iterator[ApiServer]:
    yield get_server()


@pytest.fixture(scope="session")
def small_api_server() -> Iterator[ApiServer]:
    yield get_server("small")


def cached_tokens(answer: dict[str, Any]) -> int:
    """An answer's `cached_tokens` (0 when its usage has no details: a stream without usage)."""
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def chat(client: httpx.Client, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    """POST /v1/chat/completions (greedy, short) and return the JSON; fails on a non-200."""
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def user_msg(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    """Parsed `data:` events of an SSE stream (`"[DONE]"` as the string)."""
    import json

    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        yield payload if payload == "[DONE]" else json.loads(payload)
