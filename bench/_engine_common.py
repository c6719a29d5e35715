"""Shared pieces of the engine benchmarks: the header line, a timed engine, prompts of a target
length, a store that serves RPC, and the statistics every script prints.

TTFT is read from `RequestOutput.metrics.first_token_latency` (vLLM's own arrival-to-first-token
clock, on when `disable_log_stats=False`), so a turn can generate a real answer and still be
timed to its first token; for `max_tokens=1` the wall time of `generate` is the fallback. Timed
engines run with `enforce_eager=True` (the factory's default) and the engine core and worker in
processes of their own, as a server runs them, so pages are saved between requests.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dss.store import Store
from engine_patch.setup.factory import session_params
from tests.engine_helpers import Engine, Result, make_conversations, open_store, served_by, wait_until, words

BS = 128  # the CPU backend's default block size
TOKENS_PER_WORD = 1.15  # measured for `words()` with the SmolLM2 tokenizer

__all__ = [
    "BS",
    "Engine",
    "Result",
    "ServedStore",
    "Timed",
    "TimedEngine",
    "apc_reuse",
    "capture_output",
    "computed",
    "header",
    "install_sigterm_exit",
    "make_conversations",
    "median",
    "ms",
    "pin_cpu_reservation",
    "print_result",
    "ratio",
    "root_cause",
    "served_by",
    "session_params",
    "smoke_flag",
    "text_of_tokens",
    "wait_until",
    "words",
]


def install_sigterm_exit() -> None:
    """SIGTERM runs `finally:` blocks (engines shut down) instead of orphaning engine processes."""

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def pin_cpu_reservation() -> None:
    """Give every engine the same CPU binding. vLLM's CPU worker reserves one core per rank for the
    engine core, plus one more whenever a KV connector is configured (meant for NIXL P/D); on a
    2-core machine that leaves an engine with the DSS connector no reserved core, so its worker
    binds both cores while plain vLLM's binds one. Plain vLLM's reservation (one core) for all, so
    the comparisons measure caching, not thread counts. An explicit setting wins."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")


def header(name: str) -> None:
    import vllm

    install_sigterm_exit()
    pin_cpu_reservation()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    reserved = os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"]
    print(
        f"{name}: cores={os.cpu_count()} vllm={vllm.__version__} loadavg={load} "
        f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved}",
        flush=True,
    )


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def print_result(**values: float | int) -> None:
    """The benchmark's one `RESULT key=value ...` line. A value that is not a finite number (no
    operation of a kind completed: a median of nothing, a ratio to zero) fails loudly instead of
    printing `nan`."""
    bad = [k for k, v in values.items() if not math.isfinite(v)]
    if bad:
        raise RuntimeError(f"the benchmark degenerated: no finite value for {', '.join(bad)} ({values})")
    fields = " ".join(f"{k}={v}" if isinstance(v, int) else f"{k}={v:.4f}" for k, v in values.items())
    print(f"RESULT {fields}", flush=True)


def smoke_flag(argv: Sequence[str] | None = None) -> bool:
    """`--smoke`: tiny sizes, so the test suite can run the benchmark (tests/bench/test_bench_smoke.py)."""
    args = list(sys.argv[1:] if argv is None else argv)
    unknown = [a for a in args if a != "--smoke"]
    if unknown:
        raise SystemExit(f"unknown arguments {unknown}; the only option is --smoke")
    return "--smoke" in args


def computed(turns: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[int]]:
    """The sequences whose KV DSS stored for these (prompt, output) turns: each one's prompt and
    output but the last sampled token (never computed), as whole pages and a tail page."""
    return [[*p, *o][:-1] for p, o in turns]


def apc_reuse(cached: Sequence[Sequence[int]], prompt: Sequence[int]) -> int:
    """What vLLM's own prefix cache reuses of `prompt` after it ran the prompts `cached`: only
    whole blocks of what it computed (a prompt's tokens), leaving at least one token to compute.
    A DSS load of the same history is this plus, possibly, a tail page's tokens."""
    best = 0
    for seq in cached:
        n = min(len(seq), len(prompt))
        diff = np.flatnonzero(np.asarray(seq[:n]) != np.asarray(prompt[:n]))
        best = max(best, int(diff[0]) if len(diff) else n)
    return (min(best, len(prompt) - 1) // BS) * BS


def ms(xs: Sequence[float]) -> str:
    return "[" + ", ".join(f"{1000 * x:.0f}" for x in xs) + "] ms"


def text_of_tokens(rng: np.random.Generator, n_tokens: int) -> str:
    """About `n_tokens` tokens of random words (exact lengths are printed by the callers)."""
    return words(rng, max(1, int(n_tokens / TOKENS_PER_WORD)))


@dataclass(frozen=True, slots=True)
class Timed:
    ttft_s: float
    wall_s: float
    result: Result


class TimedEngine(Engine):
    """The tests' `Engine`, with vLLM's per-request stats on and one timed request at a time."""

    def __init__(self, address: str | None, authkey: bytes | None, **overrides: Any) -> None:
        extra = dict(overrides.pop("extra_engine_args", {}))
        extra.setdefault("disable_log_stats", False)
        super().__init__(address, authkey, extra_engine_args=extra, **overrides)

    def timed(
        self, prompt: Sequence[int], sess: dict[str, Any] | None, max_tokens: int = 1, reset: bool = False
    ) -> Timed:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if reset:
            self.reset_prefix_cache()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=sess or None)
        t0 = time.perf_counter()
        (o,) = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], [params], use_tqdm=False)
        wall = time.perf_counter() - t0
        metrics = getattr(o, "metrics", None)
        ttft = getattr(metrics, "first_token_latency", 0.0) or 0.0
        if ttft <= 0.0:
            if max_tokens != 1:
                raise RuntimeError("vLLM reported no first-token latency; run with max_tokens=1")
            ttft = wall
        res = Result(
            list(o.prompt_token_ids or []),
            list(o.outputs[0].token_ids),
            o.outputs[0].text,
            o.kv_transfer_params,
            int(o.num_cached_tokens or 0),
        )
        return Timed(ttft, wall, res)

    def warm_up(self) -> None:
        """One short request, so one-time start-up costs stay out of the measured ones."""
        self.timed(self.chat_ids([{"role": "user", "content": "Hello there."}]), None, 4)


class ServedStore:
    """A store in a temporary data directory, serving RPC to engine processes; `reopen()` closes
    it and opens the same directory again (the host arena is lost, disk pages and the index stay)."""

    def __init__(self, host_gib: float = 2.0) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="dss-bench-")
        self.data_dir = Path(self._tmp.name) / "store"
        self.host_gib = host_gib
        self.store: Store = open_store(self.data_dir, host_gib=host_gib)
        self.address, self.authkey = self.store.serve_rpc()

    def reopen(self) -> None:
        self.store.close()
        self.store = open_store(self.data_dir, host_gib=self.host_gib)
        self.address, self.authkey = self.store.serve_rpc()

    def host_pages(self) -> int:
        pages = self.store.stats()["pages"]
        assert isinstance(pages, dict)
        return int(pages["host"])

    def wait_for_host_pages(self, engine: Engine, n: int, timeout_s: float) -> bool:
        """Whether the host tier holds `n` pages within `timeout_s`. An engine in this process
        steps only when asked: it is settled meanwhile, so the saves its finished requests left
        run (an engine in processes of its own runs them by itself)."""

        def reached() -> bool:
            engine.settle()
            return self.host_pages() >= n

        return wait_until(reached, timeout_s=timeout_s)

    def close(self) -> None:
        self.store.close()
        self._tmp.cleanup()


def main_on_one_engine(name: str, run: Callable[[ServedStore, TimedEngine, bool], dict[str, float]]) -> None:
    """The `main()` of a benchmark whose `run` needs one store (1 GiB host tier) and one engine
    with vLLM's prefix cache on: `--smoke` read here, the RESULT line printed from what it returns."""
    smoke = smoke_flag()
    header(name)
    served = ServedStore(host_gib=1.0)
    try:
        engine = TimedEngine(served.address, served.authkey, enable_prefix_caching=True)
        try:
            result = run(served, engine, smoke)
        finally:
            engine.close()
    finally:
        served.close()
    print_result(**result)


_ERROR = re.compile(r"\b(\w*(?:Error|Exception)): (.+)$")
_FRAME = re.compile(r'File "(?:[^"]*/site-packages/)?([^"]+)", line (\d+), in (\w+)')


@contextlib.contextmanager
def capture_output() -> Iterator[list[str]]:
    """Capture file descriptors 1 and 2 (this process and the engine processes it starts inherit
    them; vLLM logs to stdout) into a list of lines, so a failed engine start can be summed up in
    one line instead of a page of tracebacks."""
    lines: list[str] = []
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with tempfile.TemporaryFile(mode="w+b") as f:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in saved:
            os.dup2(f.fileno(), fd)
        try:
            yield lines
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            f.seek(0)
            lines.extend(f.read().decode(errors="replace").splitlines())


def root_cause(lines: Sequence[str], exc: BaseException) -> str:
    """The first exception raised in the captured engine output, with the frame that raised it;
    else the exception the caller saw."""
    frame = ""
    for line in lines:
        if m := _FRAME.search(line):
            frame = f" (at {m.group(1)}:{m.group(2)} in {m.group(3)})"
        elif m := _ERROR.search(line):
            return f"{m.group(1)}: {m.group(2).strip()}{frame}"[:300]
    return f"{type(exc).__name__}: {exc}"[:300]
