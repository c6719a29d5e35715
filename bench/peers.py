"""DSS against its peers over HTTP: the same multi-round chat workload, through the official `openai`
client, against four servers started one after another:

- `dss`: `dss serve --dev` (this project; each turn names its session with `session_id`);
- `apc`: vLLM's OpenAI server with its own prefix cache (automatic prefix caching);
- `lmcache`: the same plus LMCache's multiprocess server (`lmcache server`, L1 in host memory)
  through vLLM's `LMCacheMPConnector`;
- `nocache`: vLLM's OpenAI server with `--no-enable-prefix-caching`.

All get the same model folder, dtype, context length, block size and engine KV space
(`VLLM_CPU_KVCACHE_SPACE=1`, read with the other engine settings from `engine_patch.setup.factory`), and the
same CPU reservation (`VLLM_CPU_NUM_OF_RESERVED_CPU=1`). The working set of sessions is larger than
the engine's KV space (36 sessions growing to ~2k tokens, ~23 KiB per token for the default model:
more than 1 GiB from round 2 on), so a session's blocks are evicted from vLLM's own cache before the
session comes back: what a server keeps outside the engine decides the later rounds' TTFT.

Workload: seeded prompts (first user message of 1,000-1,600 tokens, later ones of 60-200 tokens,
lengths drawn per session), streamed, greedy (temperature 0), `--max-tokens` answer tokens; every
turn sends the full history (the server's own previous answers included). Sessions take turns
round-robin. Each server gets one throwaway request first. TTFT: from the call to the first chunk
with content, measured by the client.

The LMCache peer runs in a virtual environment of its own (`~/.cache/dss/bench/lmcache-venv`, or
`DSS_LMCACHE_VENV`) that reuses the project's packages through a `.pth` file and adds
`lmcache==0.5.6` (without its CUDA dependencies) and the few pure-Python packages it imports; the
project's `.venv` is left as it is. If it cannot be made to run, the others still run and the
result says `dss_vs_lmcache=nan` with the reason.

    .venv/bin/python bench/peers.py                       # all four (~40 min on 2 cores)
    .venv/bin/python bench/peers.py --quick --only dss,apc
    .venv/bin/python bench/peers.py --server-root /tmp/dss-head   # serve another copy of the code

The last line is `RESULT dss_vs_apc= dss_vs_lmcache= dss_vs_nocache=`: the mean TTFT of DSS over
the peer's, over rounds >= 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _procs import die_hard_with_parent, free_port, model_dir  # noqa: E402

PEERS = ("dss", "apc", "lmcache", "nocache")
LMCACHE_VERSION = "0.5.6"
LMCACHE_DEPS = ["sortedcontainers", "aiofile", "aiofiles", "redis", "httptools", "nvtx",
                "opentelemetry-exporter-prometheus"]  # fmt: skip
LMCACHE_L1_GIB = 2  # the same as DSS's default host arena (DSS_STORE__HOST_CAPACITY_BYTES)
START_TIMEOUT_S = 420.0
REQUEST_TIMEOUT_S = 300.0
USER = "peers"
# No usage reports from any server (the machine reaches no one anyway).
QUIET_ENV = {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false",
             "LMCACHE_DISABLE_BANNER": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
WORDS = (
    "apple", "river", "stone", "cloud", "garden", "window", "silver", "market", "bridge", "candle",
    "forest", "engine", "harbor", "lantern", "meadow", "needle", "orange", "pepper", "quartz", "rocket",
    "saddle", "timber", "umbrella", "violet", "wagon", "yellow", "zebra", "anchor", "basket", "copper",
    "desert", "ember", "falcon", "glacier", "hammer", "island", "jacket", "kettle", "lemon", "marble",
    "nickel", "olive", "pillow", "quiver", "ribbon", "salmon", "tunnel", "valley", "walnut", "canyon",
    "dolphin", "feather", "ginger", "helmet", "ivory", "jungle", "kayak", "ladder", "mirror", "napkin",
    "oyster", "parrot", "rabbit", "spider", "tomato", "velvet", "whistle", "blanket", "cactus", "dragon",
    "eagle", "fossil", "goblet", "harvest", "iceberg", "jasmine", "kitten", "lobster", "magnet", "nectar",
    "orchid", "pebble", "quill", "raven", "scarlet", "thunder", "uniform", "vessel", "wizard", "yogurt",
    "acorn", "bamboo", "cobalt", "dune", "elbow", "fjord", "gravel", "hazel", "inkwell",
)  # fmt: skip


# ---------------------------------------------------------------------------------- settings
_SHAPE_PY = """
import dataclasses, json, sys
from pathlib import Path
from engine_patch.setup.factory import EngineSettings, engine_kwargs
settings = dataclasses.replace(EngineSettings(model=Path(sys.argv[1])), connector=False)
kw = engine_kwargs(None, None, settings)
kw["kv_cache_space_gib"] = settings.kv_cache_space_gib
print(json.dumps(kw, default=str))
"""


def server_env_code(code_root: Path) -> dict[str, str]:
    """The environment that imports `code_root`'s copy of the project first."""
    env = {**os.environ, **QUIET_ENV}
    if code_root != REPO:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code_root), env.get("PYTHONPATH")]))
    return env


@dataclass(frozen=True)
class EngineShape:
    """What every server's engine gets, read from the factory's defaults (what `dss serve` uses)."""

    max_model_len: int
    dtype: str
    kv_cache_space_gib: int
    enforce_eager: bool
    seed: int
    block_size: int | None
    extra: dict[str, Any]  # further engine keyword arguments the factory sets (passed to vLLM as flags)

    @classmethod
    def from_factory(cls, model: Path, code_root: Path) -> EngineShape:
        """Read in a subprocess that imports the served copy of the code (`--server-root`), so the
        peers get what that `dss serve` gives its engine even when the checkout differs."""
        env = server_env_code(code_root)
        r = subprocess.run([sys.executable, "-c", _SHAPE_PY, str(model)], cwd=code_root, env=env,
                           capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
        if r.returncode != 0:
            raise SystemExit(f"reading the engine settings failed: {r.stderr.strip()[-1000:]}")
        kw = json.loads(r.stdout.strip().splitlines()[-1])
        for k in ("model", "enable_prefix_caching", "gpu_memory_utilization"):
            kw.pop(k, None)  # per peer / meaningless on CPU
        return cls(
            max_model_len=int(kw.pop("max_model_len")),
            dtype=str(kw.pop("dtype")),
            kv_cache_space_gib=int(kw.pop("kv_cache_space_gib")),
            enforce_eager=bool(kw.pop("enforce_eager")),
            seed=int(kw.pop("seed")),
            block_size=kw.pop("block_size", None),
            extra=kw,
        )

    def vllm_flags(self) -> list[str]:
        flags = ["--max-model-len", str(self.max_model_len), "--dtype", self.dtype, "--seed", str(self.seed)]
        if self.enforce_eager:
            flags.append("--enforce-eager")
        if self.block_size is not None:
            flags += ["--block-size", str(self.block_size)]
        for k, v in self.extra.items():
            name = "--" + k.replace("_", "-")
            if isinstance(v, bool):
                flags.append(name if v else "--no-" + name[2:])
            elif isinstance(v, dict | list):
                flags += [name, json.dumps(v)]
            else:
                flags += [name, str(v)]
        return flags


def server_env(shape: EngineShape, code_root: Path) -> dict[str, str]:
    env = server_env_code(code_root)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(shape.kv_cache_space_gib)
    # One reserved core for every engine: vLLM reserves one more when a KV connector is configured
    # (DSS's, LMCache's), which on 2 cores would leave those engines a different thread binding.
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    return env


# ---------------------------------------------------------------------------------- processes
class Proc:
    """A server in its own process group (its engine processes included), logging to a file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path, cwd: Path) -> None:
        self.name, self.log = name, log
        with open(log, "ab") as f:
            self.p = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_hard_with_parent,
            )  # fmt: skip

    def tail(self, n: int = 2500) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def wait_ready(self, url: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited during start-up ({self.p.returncode}):\n{self.tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=3).status_code == 200:
                    return
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM to the group, then SIGKILL to whatever is left of it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.p.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # engine processes of the group may outlive the leader
            try:
                os.killpg(self.p.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


@contextlib.contextmanager
def servers() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for p in reversed(procs):
            p.stop()


# ---------------------------------------------------------------------------------- LMCache
def lmcache_venv() -> Path:
    return Path(os.environ.get("DSS_LMCACHE_VENV", Path.home() / ".cache" / "dss" / "bench" / "lmcache-venv"))


def ensure_lmcache() -> Path:
    """The LMCache venv's python (created on first use); raises RuntimeError with the reason."""
    venv = lmcache_venv()
    py = venv / "bin" / "python"
    probe = [str(py), "-c", "import lmcache, vllm; print(lmcache.__file__)"]

    def ok() -> bool:
        if not (venv / "bin" / "lmcache").exists():
            return False
        return (
            subprocess.run(
                probe, capture_output=True, timeout=300, env={**os.environ, **QUIET_ENV}
            ).returncode
            == 0
        )

    if py.exists() and ok():
        return py

    def run(cmd: list[str]) -> None:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd[:6])} ...` failed: {(r.stderr or r.stdout).strip()[-300:]}")

    print(f"creating the LMCache venv in {venv}", flush=True)
    run([sys.executable, "-m", "venv", str(venv)])
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    # The project's packages (vllm, torch, ...) come after the venv's own on the path.
    (site / "dss-project-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run([*pip, "--no-deps", f"lmcache=={LMCACHE_VERSION}"])
    run([*pip, *LMCACHE_DEPS])
    if not ok():
        raise RuntimeError("lmcache was installed but `import lmcache, vllm` fails in its venv")
    return py


# ---------------------------------------------------------------------------------- workload
@dataclass
class Script:
    first: list[str]  # per session
    followups: list[list[str]]  # per session, per later round


def make_script(n_sessions: int, rounds: int, first_range: tuple[int, int], follow_range: tuple[int, int],
                seed: int, model: Path) -> Script:  # fmt: skip
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    rng = np.random.default_rng(seed)

    def text(prefix: str, n_tokens: int) -> str:
        """`prefix` and random words, about `n_tokens` tokens in all."""
        n_words = max(1, int(n_tokens / 1.3))
        for _ in range(3):
            body = " ".join(rng.choice(WORDS, size=n_words))
            got = len(tok.encode(prefix + body).ids)
            if abs(got - n_tokens) <= max(8, n_tokens // 50):
                break
            n_words = max(1, int(n_words * n_tokens / max(got, 1)))
        return prefix + body

    first, followups = [], []
    for s in range(n_sessions):
        n = int(rng.integers(first_range[0], first_range[1] + 1))
        first.append(text(f"Session {s}. Remember these words, I will ask about them: ", n))
        later = []
        for r in range(2, rounds + 1):
            m = int(rng.integers(follow_range[0], follow_range[1] + 1))
            later.append(text(f"Round {r}. Which of my words relate to these: ", m))
        followups.append(later)
    return Script(first, followups)


@dataclass
class Turn:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int


@dataclass
class Column:
    name: str
    turns: dict[int, list[Turn]] = field(default_factory=dict)  # round -> turns
    failed: str | None = None
    load: tuple[float, float] = (float("nan"), float("nan"))  # 1-min loadavg at start / end of rounds

    def later(self) -> list[float]:
        return [t.ttft_s for r, ts in self.turns.items() if r >= 2 for t in ts]

    def mean_later(self) -> float:
        xs = self.later()
        return float(np.mean(xs)) if xs and self.failed is None else float("nan")


def chat_turn(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int,
              extra_body: dict[str, Any] | None) -> tuple[Turn, str]:  # fmt: skip
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra_body or None,
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta.content
            if delta:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(delta)
            elif ttft is None and chunk.choices[0].finish_reason:
                ttft = time.perf_counter() - t0  # an answer that is empty
        if chunk.usage is not None:
            usage = chunk.usage
    if usage is None:
        raise RuntimeError("the stream carried no usage")
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    turn = Turn(ttft if ttft is not None else time.perf_counter() - t0, int(usage.prompt_tokens),
                None if cached is None else int(cached), int(usage.completion_tokens))  # fmt: skip
    return turn, "".join(parts)


def run_workload(col: Column, base_url: str, script: Script, rounds: int, max_tokens: int,
                 session_ids: bool) -> None:  # fmt: skip
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="dev", default_headers={"X-DSS-User": USER},
                    timeout=REQUEST_TIMEOUT_S, max_retries=0)  # fmt: skip
    model = client.models.list().data[0].id
    n = len(script.first)
    # one throwaway request: one-time start-up costs stay out of the measured ones
    warm = [{"role": "user", "content": "Hello there, who are you?"}]
    chat_turn(client, model, warm, 8, {"session_id": f"{USER}-warmup"} if session_ids else None)
    histories: list[list[dict[str, str]]] = [[] for _ in range(n)]
    col.load = (os.getloadavg()[0], float("nan"))
    for rnd in range(1, rounds + 1):
        col.turns[rnd] = []
        for s in range(n):  # round-robin: the working set cycles through the cache
            user = script.first[s] if rnd == 1 else script.followups[s][rnd - 2]
            histories[s].append({"role": "user", "content": user})
            extra = {"session_id": f"{USER}-{s}"} if session_ids else None
            turn, answer = chat_turn(client, model, histories[s], max_tokens, extra)
            histories[s].append({"role": "assistant", "content": answer})
            col.turns[rnd].append(turn)
        print_round(col, rnd)
    col.load = (col.load[0], os.getloadavg()[0])


def print_round(col: Column, rnd: int) -> None:
    ts = col.turns[rnd]
    ttft = [t.ttft_s for t in ts]
    cached = [t.cached_tokens for t in ts if t.cached_tokens is not None]
    cached_s = f"{np.mean(cached):5.0f}" if cached else "    ?"
    print(
        f"  {col.name:8s} round {rnd}: TTFT mean {1000 * np.mean(ttft):6.0f} ms "
        f"(median {1000 * np.median(ttft):5.0f}, max {1000 * max(ttft):5.0f})  "
        f"prompt {np.mean([t.prompt_tokens for t in ts]):5.0f} tok, cached {cached_s} tok, "
        f"answer {np.mean([t.completion_tokens for t in ts]):3.0f} tok",
        flush=True,
    )


# ---------------------------------------------------------------------------------- the peers
def start_dss(procs: list[Proc], shape: EngineShape, model: Path, root: Path, code_root: Path,
              name: str = "dss", settings: dict[str, str] | None = None) -> str:  # fmt: skip
    """`dss serve --dev` on its own data directory (`root/<name>-data`), with `settings` (DSS_*
    variables) on top of the shape's."""
    port = free_port()
    env = server_env(shape, code_root)
    env.update({
        "DSS_ENGINE__MAX_MODEL_LEN": str(shape.max_model_len),
        "DSS_ENGINE__KV_CACHE_SPACE_GIB": str(shape.kv_cache_space_gib),
        # The peers' engines run at the caller's priority: so does this one (nice 0 = unchanged).
        "DSS_ENGINE__CPU_PRIORITY": "nice",
        "DSS_ENGINE__NICE": "0",
        **(settings or {}),
    })  # fmt: skip
    script = Path(sys.executable).with_name("dss")
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "api.cli"]
    cmd = [*cli, "serve", "--dev", "--model", str(model), "--data-dir", str(root / f"{name}-data"),
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    label = "dss serve" if name == "dss" else f"dss serve ({name})"
    proc = Proc(label, cmd, env, root / f"{name}.log", code_root)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(url + "/readyz")
    return url


def start_vllm(procs: list[Proc], shape: EngineShape, model: Path, root: Path, name: str, python: str,
               prefix_caching: bool, kv_transfer: dict[str, Any] | None = None) -> str:  # fmt: skip
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), *shape.vllm_flags(),
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
           "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]  # fmt: skip
    if kv_transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer)]
    proc = Proc(f"vLLM ({name})", cmd, server_env(shape, REPO), root / f"{name}.log", REPO)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    proc.wait_ready(url + "/health")
    return url


def start_lmcache(procs: list[Proc], shape: EngineShape, model: Path, root: Path) -> str:
    py = ensure_lmcache()
    lm_bin = str(py.with_name("lmcache"))
    port, http_port = free_port(), free_port()
    chunk = shape.block_size or 128  # one LMCache chunk per engine block (the CPU block size: 128)
    # `--supported-transfer-mode auto`: the default (lmcache_driven) hangs at register_kv_caches on CPU.
    cmd = [lm_bin, "server", "--host", "localhost", "--port", str(port), "--http-host", "127.0.0.1",
           "--http-port", str(http_port), "--l1-size-gb", str(LMCACHE_L1_GIB), "--eviction-policy", "LRU",
           "--chunk-size", str(chunk), "--supported-transfer-mode", "auto"]  # fmt: skip
    proc = Proc("lmcache server", cmd, server_env(shape, REPO), root / "lmcache-server.log", REPO)
    procs.append(proc)
    proc.wait_ready(f"http://127.0.0.1:{http_port}/healthcheck", 180)
    extra = {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": port}
    kv = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return start_vllm(procs, shape, model, root, "lmcache", str(py), True, kv)


def run_peer(name: str, args: argparse.Namespace, shape: EngineShape, model: Path, script: Script,
             root: Path) -> Column:  # fmt: skip
    col = Column(name)
    t0 = time.monotonic()
    try:
        with servers() as procs:
            if name == "dss":
                url = start_dss(procs, shape, model, root, args.server_root)
            elif name == "apc":
                url = start_vllm(procs, shape, model, root, name, sys.executable, True)
            elif name == "nocache":
                url = start_vllm(procs, shape, model, root, name, sys.executable, False)
            else:
                url = start_lmcache(procs, shape, model, root)
            print(f"{name}: ready in {time.monotonic() - t0:.0f} s", flush=True)
            t1 = time.monotonic()
            run_workload(col, url, script, args.rounds, args.max_tokens, session_ids=name == "dss")
            print(f"{name}: {args.rounds} rounds in {time.monotonic() - t1:.0f} s", flush=True)
    except (RuntimeError, OSError, httpx.HTTPError, subprocess.SubprocessError) as exc:
        col.failed = " ".join(str(exc).split("\n")[0].split())[:300] or type(exc).__name__
        print(f"{name}: FAILED after {time.monotonic() - t0:.0f} s: {col.failed}", flush=True)
        tail = str(exc).split("\n", 1)[1:] if "\n" in str(exc) else []
        if tail:
            print("  " + "\n  ".join(tail[0].splitlines()[-15:]), flush=True)
    except Exception as exc:  # an openai error, an odd answer: that column fails, the others go on
        col.failed = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
        print(f"{name}: FAILED after {time.monotonic() - t0:.0f} s: {col.failed}", flush=True)
    return col


# ---------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--sessions", type=int, default=None, help="sessions (default 36; --quick: 8)")
    p.add_argument("--rounds", type=int, default=None, help="turns per session (default 4; --quick: 3)")
    p.add_argument("--max-tokens", type=int, default=None, help="answer tokens (default 64; --quick: 16)")
    p.add_argument("--quick", action="store_true", help="a short run: a few minutes, working set < 1 GiB")
    p.add_argument("--only", default=",".join(PEERS), help=f"comma-separated subset of {','.join(PEERS)}")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--server-root", type=Path, default=REPO,
                   help="the copy of this project `dss serve` runs (e.g. a `git archive HEAD`)")  # fmt: skip
    p.add_argument("--keep", type=Path, default=None, help="keep the servers' logs in this folder")
    args = p.parse_args(argv)
    args.sessions = args.sessions or (8 if args.quick else 36)
    args.rounds = args.rounds or (3 if args.quick else 4)
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)
    args.only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in args.only if x not in PEERS]
    if unknown or args.rounds < 2:
        p.error(f"unknown peers {unknown}" if unknown else "--rounds must be at least 2")
    args.server_root = args.server_root.resolve()
    return args


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 and not np.isnan(a) and not np.isnan(b) else float("nan")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # runs the `finally:` blocks: servers stopped

    signal.signal(signal.SIGTERM, _exit)
    import vllm

    model = model_dir()
    shape = EngineShape.from_factory(model, args.server_root)
    cfg = json.loads((model / "config.json").read_text())
    layers, kv_heads = int(cfg["num_hidden_layers"]), int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    dtype_bytes = 4 if shape.dtype in ("float32", "float") else 2
    per_token = 2 * layers * kv_heads * head_dim * dtype_bytes
    first_range = (1000, 1600) if not args.quick else (500, 900)
    follow_range = (60, 200)
    script = make_script(args.sessions, args.rounds, first_range, follow_range, args.seed, model)
    est_r2 = args.sessions * (np.mean(first_range) + np.mean(follow_range) + args.max_tokens)
    est_last = args.sessions * (
        np.mean(first_range) + (args.rounds - 1) * (np.mean(follow_range) + args.max_tokens)
    )
    engine_tokens = shape.kv_cache_space_gib * (1 << 30) / per_token
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"peers: cores={os.cpu_count()} vllm={vllm.__version__} loadavg={load} model={model.name} "
        f"dtype={shape.dtype} max_model_len={shape.max_model_len} block_size={shape.block_size or 'default'} "
        f"VLLM_CPU_KVCACHE_SPACE={shape.kv_cache_space_gib}",
        flush=True,
    )
    print(
        f"sessions={args.sessions} rounds={args.rounds} max_tokens={args.max_tokens} first message "
        f"{first_range[0]}-{first_range[1]} tokens, later ones {follow_range[0]}-{follow_range[1]}; "
        f"KV {per_token:,} B/token: engine space ~{engine_tokens:,.0f} tokens, working set ~{est_r2:,.0f} "
        f"tokens at round 2, ~{est_last:,.0f} at round {args.rounds}; server code {args.server_root}",
        flush=True,
    )
    root = Path(tempfile.mkdtemp(prefix="dss-bench-peers-"))
    cols: dict[str, Column] = {}
    try:
        for name in args.only:
            cols[name] = run_peer(name, args, shape, model, script, root)
    finally:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for f in root.glob("*.log"):
                shutil.copy(f, args.keep / f.name)
        shutil.rmtree(root, ignore_errors=True)

    print("mean TTFT of rounds >= 2 (round 1 is cold everywhere):")
    for name, c in cols.items():
        if c.failed:
            print(f"  {name:8s} did not run: {c.failed}")
            continue
        r1 = np.mean([t.ttft_s for t in c.turns[1]])
        cached = [
            t.cached_tokens for r, ts in c.turns.items() if r >= 2 for t in ts if t.cached_tokens is not None
        ]
        cached_s = f"{np.mean(cached):.0f}" if cached else "?"
        print(
            f"  {name:8s} {1000 * c.mean_later():6.0f} ms (median {1000 * np.median(c.later()):5.0f})  "
            f"round 1: {1000 * r1:5.0f} ms  mean cached tokens {cached_s}  "
            f"loadavg {c.load[0]:.1f} -> {c.load[1]:.1f}"
        )
    dss = cols.get("dss")
    dss_mean = dss.mean_later() if dss is not None else float("nan")
    out = []
    for peer in ("apc", "lmcache", "nocache"):
        c = cols.get(peer)
        value = ratio(dss_mean, c.mean_later()) if c is not None else float("nan")
        if np.isnan(value):
            why = (
                "dss did not run" if dss is None else f"dss failed: {dss.failed}" if dss.failed
                else "not run (--only)" if c is None else f"failed: {c.failed}"
            )  # fmt: skip
            print(f"dss_vs_{peer}=nan: {peer} {why}" if "dss" not in why else f"dss_vs_{peer}=nan: {why}")
        out.append(f"dss_vs_{peer}={value:.4f}")
    print("RESULT " + " ".join(out), flush=True)


if __name__ == "__main__":
    main()
