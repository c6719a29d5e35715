"""Unauthenticated large bodies against another user's latency (issue 19, item 12).

Starts `dss serve --no-engine` on loopback in a temp directory, gives a victim user a few
sessions, then times the victim's `GET /v1/sessions` twice: alone, and while attacker processes
post ~8 MB JSON bodies with no API key (or a wrong one) as fast as the server takes them. Before
the fix the server read and parsed every such body on its event loop before it looked at the
key; now it refuses them (401) from the headers alone.

Bounded: DSS_BENCH_SECONDS per phase (default 10), DSS_BENCH_ATTACKERS processes (default 4),
DSS_BENCH_BODY_BYTES per post (default 7.8 MB, under the 8 MiB body limit),
DSS_BENCH_POSTS_PER_S per attacker (default 0: as fast as the server takes them; set it to
compare servers at the same attack rate, since a server that refuses cheaply is posted to
faster, and on a small machine the attackers' own CPU then slows the victim). Prints one
`RESULT` line per phase: victim latency p50/p95/max in ms, and the attackers' posts by status
(0: the server closed the connection before the client had sent the whole body).
"""

from __future__ import annotations

import http.client
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.api_server import ApiServer  # noqa: E402

SECONDS = float(os.environ.get("DSS_BENCH_SECONDS", "10"))
ATTACKERS = int(os.environ.get("DSS_BENCH_ATTACKERS", "4"))
BODY_BYTES = int(os.environ.get("DSS_BENCH_BODY_BYTES", str(7_800_000)))
POSTS_PER_S = float(os.environ.get("DSS_BENCH_POSTS_PER_S", "0"))


def attacker(port: int, seconds: float, counts: mp.Queue[tuple[int, dict[int, int]]]) -> None:
    """Post big bodies without a valid key until the time is up; report how many, by status."""
    body = b'{"system_prompt": "' + b"x" * BODY_BYTES + b'"}'
    deadline = time.monotonic() + seconds
    statuses: dict[int, int] = {}
    posts = 0
    began = time.monotonic()
    while time.monotonic() < deadline:
        if POSTS_PER_S > 0:
            time.sleep(max(0.0, began + posts / POSTS_PER_S - time.monotonic()))
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            headers = {"Content-Type": "application/json"}
            if posts % 2:
                headers["Authorization"] = "Bearer dss-not-a-key"
            conn.request("POST", "/v1/sessions", body=body, headers=headers)
            status = conn.getresponse().status
        except OSError:
            status = 0  # the server closed the connection before the whole body was sent
        finally:
            conn.close()
        posts += 1
        statuses[status] = statuses.get(status, 0) + 1
    counts.put((posts, statuses))


def victim(client: httpx.Client, seconds: float) -> list[float]:
    times = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        start = time.perf_counter()
        r = client.get("/v1/sessions")
        times.append((time.perf_counter() - start) * 1e3)
        assert r.status_code == 200, r.text
        time.sleep(0.01)
    return times


def report(phase: str, times: list[float], extra: str = "") -> None:
    q = statistics.quantiles(times, n=20)
    print(
        f"RESULT phase={phase} requests={len(times)} p50_ms={statistics.median(times):.1f} "
        f"p95_ms={q[18]:.1f} max_ms={max(times):.1f}{extra}",
        flush=True,
    )


def main() -> None:
    smoke = "--smoke" in sys.argv[1:]  # tiny sizes, seconds (the suite runs this)
    seconds, attackers = (1.0, 1) if smoke else (SECONDS, ATTACKERS)
    with tempfile.TemporaryDirectory(prefix="dss-auth-flood-") as tmp:
        server = ApiServer(None, Path(tmp))
        server.start()
        try:
            with server.client("victim", timeout=60) as c:
                for i in range(5):
                    c.post(
                        "/v1/sessions", json={"session_id": f"s{i}", "metadata": {"i": i}}
                    ).raise_for_status()
                victim(c, 1.0)  # warm-up
                report("alone", victim(c, seconds))
                counts: mp.Queue[tuple[int, dict[int, int]]] = mp.Queue()
                procs = [
                    mp.Process(target=attacker, args=(server.port, seconds + 1, counts))
                    for _ in range(attackers)
                ]
                for p in procs:
                    p.start()
                time.sleep(0.5)
                times = victim(c, seconds)
                results = [counts.get(timeout=120) for _ in procs]
                for p in procs:
                    p.join(30)
                posts = sum(n for n, _ in results)
                statuses: dict[int, int] = {}
                for _, s in results:
                    for k, v in s.items():
                        statuses[k] = statuses.get(k, 0) + v
                shown = ",".join(f"{k}:{v}" for k, v in sorted(statuses.items()))
                report("flood", times, f" attackers={attackers} posts={posts} statuses={shown}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
