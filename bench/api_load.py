"""A bounded load on the real server over loopback: chat turns, rollbacks, branches and reads.

Starts `dss serve` (real vLLM CPU engine, default model) in a temp data directory, then runs
N clients (default 32) for T seconds (default 60), each on its own session with its own API key:
about half the operations are streamed chat turns through `/messages`, the rest rollbacks to an
ancestor of the branch head, new branches at a random version, and version-tree reads. Reports
requests/s, p50/p99 of each operation, TTFT of first (cold) vs later (cached) turns side by side,
and errors (goal: 0; rollback/branch p99 <= 20 ms). Beside them, what every timing includes: this
process's own event-loop delay, and from the server's metrics its loop's lateness
(`dss_event_loop_lag_seconds`) and where its rollbacks and branches ran (`dss_short_writes_total`).

Env: DSS_BENCH_CLIENTS, DSS_BENCH_SECONDS, DSS_BENCH_URL + DSS_BENCH_KEYS (comma-separated keys,
one per client) to load an already running server instead of starting one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._procs import die_with_parent, free_port, model_dir, serve_command  # noqa: E402 - after the path is set

CLIENTS = int(os.environ.get("DSS_BENCH_CLIENTS", "32"))
SECONDS = float(os.environ.get("DSS_BENCH_SECONDS", "60"))
MAX_TOKENS = 8
SYSTEM = "You are a concise assistant of a hardware store. " + " ".join(
    f"Aisle {i} holds {item}; answer in one short sentence." for i, item in enumerate(
        ["nails", "screws", "paint", "glue", "rope", "tape", "hinges", "brushes", "ladders", "hammers",
         "saws", "drills", "bolts", "washers", "chains", "locks", "pipes", "valves", "wire", "fuses"] * 2
    )
)  # fmt: skip
QUESTIONS = ["Where are the nails?", "Do you sell paint?", "What about rope?", "Any ladders?", "And glue?"]


@dataclass
class Stats:
    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    ttft_cold: list[float] = field(default_factory=list)
    ttft_warm: list[float] = field(default_factory=list)
    cached_warm: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    requests: int = 0
    completed: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # 2xx answers by kind
    client_lag: list[float] = field(default_factory=list)  # this process's own event-loop delay

    def degenerate_kinds(self) -> list[str]:
        """The operations of which not one completed (no success: a p99 of nothing is `nan`)."""
        done = {**self.completed, "ttft_cold": len(self.ttft_cold), "ttft_warm": len(self.ttft_warm)}
        return [kind for kind in OPERATIONS if not done.get(kind)]


# What every run must complete at least once for its figures to mean anything: the operation
# kinds of `Client.run`, and both kinds of turn whose time to first token is reported.
OPERATIONS = ("chat", "rollback", "branch", "get_session", "ttft_cold", "ttft_warm")


def make_keys(data_dir: Path, n: int, admin: bool = False) -> list[str]:
    from api.keys.api_keys import ApiKeys
    from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, upgrade_to_head

    url = sqlite_url_for(data_dir)
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        keys = ApiKeys(make_session_factory(engine))
        if admin:
            return [keys.create(None, admin=True).key]
        return [keys.create(f"bench-{i}").key for i in range(n)]
    finally:
        engine.dispose()


def start_server(root: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "DSS_ENGINE__MAX_MODEL_LEN": "2048",
        "DSS_ENGINE__MAX_INFLIGHT": str(max(64, CLIENTS * 2)),
        "DSS_STORE__HOST_CAPACITY_BYTES": str(1 << 30),
        "DSS_STORE__FSYNC": "false",
    }
    cmd = serve_command(model_dir(), root / "data", port)
    log = open(root / "server.log", "wb")  # noqa: SIM115 - owned by the subprocess
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
    )
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("server exited:\n" + (root / "server.log").read_text(errors="replace")[-4000:])
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return proc, url
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server not ready after 300 s")


class Client:
    """One user on one session; it knows its version tree, so every call it makes is valid."""

    def __init__(self, i: int, http: httpx.AsyncClient, stats: Stats) -> None:
        self.i, self.http, self.stats = i, http, stats
        self.sid = f"load-{i}"
        self.parents: dict[int, int | None] = {}
        self.head = 0
        self.rng = random.Random(i)
        self.n_branches = 0

    async def timed(
        self, kind: str, method: str, path: str, body: object | None = None
    ) -> httpx.Response | None:
        t0 = time.perf_counter()
        try:
            r = await self.http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            self.stats.errors[f"{kind}:{type(exc).__name__}"] += 1
            return None
        self.stats.latency[kind].append(time.perf_counter() - t0)
        self.stats.requests += 1
        if r.status_code >= 400:
            self.stats.errors[f"{kind}:{r.status_code}"] += 1
            return None
        self.stats.completed[kind] += 1
        return r

    async def setup(self) -> None:
        body = {"session_id": self.sid, "system_prompt": f"{SYSTEM} You serve customer {self.i}."}
        await self.timed("create_session", "POST", "/v1/sessions", body)

    async def turn(self) -> None:
        body = {
            "content": self.rng.choice(QUESTIONS),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        cold = self.head == 0
        t0 = time.perf_counter()
        ttft = None
        final: dict[str, object] = {}
        try:
            async with self.http.stream("POST", f"/v1/sessions/{self.sid}/messages", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    self.stats.errors[f"chat:{r.status_code}"] += 1
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.stats.errors[f"chat:{event['error'].get('code')}"] += 1
                        return
                    if ttft is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                        ttft = time.perf_counter() - t0
                    if "usage" in event:
                        final = event
        except httpx.HTTPError as exc:
            self.stats.errors[f"chat:{type(exc).__name__}"] += 1
            return
        self.stats.requests += 1
        self.stats.latency["chat"].append(time.perf_counter() - t0)
        version = final.get("state_version")
        if not isinstance(version, int):
            self.stats.errors["chat:no_version"] += 1
            return
        self.parents[version] = self.head or None
        self.head = version
        self.stats.completed["chat"] += 1
        if ttft is not None:
            (self.stats.ttft_cold if cold else self.stats.ttft_warm).append(ttft)
        if not cold:
            usage = final["usage"]
            assert isinstance(usage, dict)
            self.stats.cached_warm.append(int(usage["prompt_tokens_details"]["cached_tokens"]))

    async def rollback(self) -> None:
        chain, v = [], self.head
        while v:
            chain.append(v)
            v = self.parents[v] or 0
        target = self.rng.choice(chain)
        r = await self.timed("rollback", "POST", f"/v1/sessions/{self.sid}/rollback", {"to_version": target})
        if r is not None:
            self.head = target

    async def branch(self) -> None:
        self.n_branches += 1
        body = {"from_version": self.rng.choice(list(self.parents)), "name": f"b{self.n_branches}"}
        await self.timed("branch", "POST", f"/v1/sessions/{self.sid}/branches", body)

    async def read(self) -> None:
        await self.timed("get_session", "GET", f"/v1/sessions/{self.sid}")

    async def run(self, until: float) -> None:
        await self.setup()
        while time.monotonic() < until:
            roll = self.rng.random()
            if self.head == 0 or roll < 0.5:
                await self.turn()
            elif roll < 0.75:
                await self.rollback()
            elif roll < 0.9:
                await self.branch()
            else:
                await self.read()


LAG = "event loop"  # `server_side`'s key for the server's own loop lag (`api.loop_lag`)


def server_side(url: str, admin_key: str | None) -> dict[str, tuple[int, float]]:
    """Per route: (requests, share answered within 20 ms), from the server's own histogram; and
    under `LAG`, (timer wake-ups, share of them late by at most 5 ms)."""
    if admin_key is None:
        return {}
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30).text
    buckets: dict[str, dict[str, float]] = defaultdict(dict)
    for line in text.splitlines():
        if line.startswith("dss_request_duration_seconds_bucket{"):
            labels, value = line[len("dss_request_duration_seconds_bucket{") :].split("} ")
            parts = dict(p.split("=", 1) for p in labels.split(","))
            buckets[parts["route"].strip('"')][parts["le"].strip('"')] = float(value)
        elif line.startswith("dss_event_loop_lag_seconds_bucket{"):
            labels, value = line[len("dss_event_loop_lag_seconds_bucket{") :].split("} ")
            buckets[LAG][labels.split("=", 1)[1].strip('"')] = float(value)
        elif line.startswith("dss_short_writes_total{"):
            print(f"server's short writes: {line}")
    out = {}
    for route, b in buckets.items():
        total, within = b.get("+Inf", 0.0), b.get("0.005" if route == LAG else "0.02", 0.0)
        if total:
            out[route] = (int(total), within / total)
    return out


async def probe_lag(stats: Stats, until: float, every_s: float = 0.005) -> None:
    """How late this process's own event loop wakes a sleeper: every latency the clients time
    includes it (32 clients parse their streams in this one loop, on the server's machine)."""
    while time.monotonic() < until:
        t0 = time.perf_counter()
        await asyncio.sleep(every_s)
        stats.client_lag.append(time.perf_counter() - t0 - every_s)


async def load(url: str, keys: list[str]) -> tuple[Stats, float]:
    stats = Stats()
    limits = httpx.Limits(max_connections=len(keys) + 4, max_keepalive_connections=len(keys) + 4)
    clients = [
        httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {k}"}, timeout=300, limits=limits)
        for k in keys
    ]
    try:
        t0 = time.monotonic()
        until = t0 + SECONDS
        await asyncio.gather(
            probe_lag(stats, until), *(Client(i, c, stats).run(until) for i, c in enumerate(clients))
        )
        return stats, time.monotonic() - t0
    finally:
        for c in clients:
            await c.aclose()


def _log_summary(path: Path) -> None:
    """Warnings and errors the server logged during the run (the log itself is deleted)."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    bad = [ln for ln in lines if " WARNING " in ln or " ERROR " in ln or "Traceback" in ln]
    bad = [ln for ln in bad if "deprecated" not in ln and "[shutdown]" not in ln]
    print(f"server log: {len(bad)} warning/error lines")
    for ln in bad[-int(os.environ.get("DSS_BENCH_LOG_LINES", "8")) :]:
        print("  " + ln[:240])


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1000 if values else float("nan")


def main() -> None:
    import vllm

    print(f"cores={os.cpu_count()} vllm={vllm.__version__} clients={CLIENTS} seconds={SECONDS:g}")
    root = Path(tempfile.mkdtemp(prefix="dss-bench-api-"))
    proc = None
    admin: str | None = os.environ.get("DSS_BENCH_ADMIN_KEY")
    try:
        if os.environ.get("DSS_BENCH_URL"):
            url, keys = os.environ["DSS_BENCH_URL"], os.environ["DSS_BENCH_KEYS"].split(",")[:CLIENTS]
        else:
            keys = make_keys(root / "data", CLIENTS)
            admin = make_keys(root / "data", 1, admin=True)[0]
            t0 = time.monotonic()
            proc, url = start_server(root)
            print(f"server ready in {time.monotonic() - t0:.1f} s")
        stats, elapsed = asyncio.run(load(url, keys))
        served = server_side(url, admin)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            _log_summary(root / "server.log")
        shutil.rmtree(root, ignore_errors=True)

    errors = sum(stats.errors.values())
    rps = stats.requests / elapsed
    print(f"requests={stats.requests} in {elapsed:.1f} s -> {rps:.1f} requests/s")
    print(f"errors={errors} {dict(stats.errors)}")
    print(f"{'operation':<16}{'count':>7}{'p50 ms':>10}{'p99 ms':>10}")
    for kind in sorted(stats.latency):
        lat = stats.latency[kind]
        print(f"{kind:<16}{len(lat):>7}{pct(lat, 50):>10.1f}{pct(lat, 99):>10.1f}")
    if stats.client_lag:
        print(f"client's own loop delay (in every timing above): p50={pct(stats.client_lag, 50):.1f} ms "
              f"p99={pct(stats.client_lag, 99):.1f} ms")  # fmt: skip
    for route in ("/v1/sessions/{session_id}/rollback", "/v1/sessions/{session_id}/branches"):
        if route in served:
            n, share = served[route]
            print(f"server side {route}: {n} requests, {share:.1%} answered within 20 ms")
    if LAG in served:
        n, share = served[LAG]
        print(f"server's event loop: {share:.1%} of {n} timer wake-ups late by at most 5 ms")
    # A run where some operation never completed (an overloaded engine: no rollback got a turn
    # to roll back to) has no figure for it: fail and say which, instead of printing `nan`.
    missing = stats.degenerate_kinds()
    if missing:
        done = {kind: stats.completed.get(kind, 0) for kind in OPERATIONS[:4]}
        raise SystemExit(
            f"the benchmark degenerated: no {', '.join(missing)} completed in {elapsed:.0f} s "
            f"(completed: {done}, cold/warm turns timed: {len(stats.ttft_cold)}/{len(stats.ttft_warm)}, "
            f"errors: {dict(stats.errors)}); lower DSS_BENCH_CLIENTS or raise DSS_BENCH_SECONDS"
        )
    cold50, warm50 = pct(stats.ttft_cold, 50), pct(stats.ttft_warm, 50)
    print(f"ttft first turn (cold) p50={cold50:.1f} ms | later turns (cached) p50={warm50:.1f} ms | "
          f"cached/cold={warm50 / cold50:.2f}")  # fmt: skip
    if stats.cached_warm:
        print(f"cached prompt tokens on later turns: mean {np.mean(stats.cached_warm):.0f}")
    all_ttft = stats.ttft_cold + stats.ttft_warm
    rollback_p99 = pct(stats.latency["rollback"], 99)
    print(
        f"RESULT requests_per_s={rps:.1f} errors={errors} rollback_p99_ms={rollback_p99:.1f} "
        f"ttft_p50_ms={pct(all_ttft, 50):.1f}"
    )


if __name__ == "__main__":
    main()
