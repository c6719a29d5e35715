"""Time to first token of a session turn whose KV is on disk, with and without a warm-up first.

Starts `dss serve` (real vLLM CPU engine, default model) in a temp data directory, runs one long
first turn in each of N sessions (each its own text, ~1,100 tokens of KV), then restarts the server:
the host arena and vLLM's own prefix cache are gone, every page is on disk only. Then, in
interleaved pairs, the next turn of one session is sent at once (cold: its pages are promoted
from disk while the turn waits) and the next turn of another is sent after `POST
/v1/sessions/{id}/warm` and a pause that stands for the user typing (default 1 s; the cold turn
waits as long, without the warm-up). A first, unmeasured disk-hit turn of an extra session
primes the restarted server. TTFT is the time from sending the streamed turn to its first
content chunk.

    .venv/bin/python bench/warm.py [--sessions N] [--typing-s S]

Env: DSS_MODEL_DIR (default: the prepared default model).
Last line: RESULT warm_vs_cold_disk=… (median warm TTFT / median cold TTFT; < 1 is good)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._procs import model_dir  # noqa: E402
from tests.api_server import ApiServer  # noqa: E402 - a real `dss serve` in a subprocess, as in the tests

FIRST_WORDS = 180  # ~1,100 tokens of the default model (about 6 per word)


def first_text(i: int) -> str:
    words = [f"s{i}w{k}" for k in range(FIRST_WORDS)]
    return f"Session {i}. Remember these words and repeat the last one: " + " ".join(words)


def turn(c: httpx.Client, sid: str, content: str) -> tuple[float, dict[str, Any]]:
    """A streamed `/messages` turn: (seconds to the first content chunk, the `dss` usage block)."""
    body = {"content": content, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    ttft: float | None = None
    info: dict[str, Any] = {}
    with c.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"turn failed: {r.status_code} {r.read()!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise SystemExit(f"turn failed: {event}")
            if ttft is None and event.get("choices") and event["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if event.get("dss"):
                info = event["dss"]
    return (ttft if ttft is not None else time.perf_counter() - t0), info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8, help="sessions (half cold, half warmed)")
    ap.add_argument("--typing-s", type=float, default=1.0, help="pause between the warm-up and the turn")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="dss-bench-warm-"))
    server = ApiServer(model_dir(), root, env={"DSS_STORE__HOST_CAPACITY_BYTES": str(512 << 20)})
    try:
        server.start()
        n = args.sessions + args.sessions % 2
        with server.client("warm-bench", timeout=600) as c:
            for i in range(n + 1):  # the last one primes the restarted server (not measured)
                assert c.post("/v1/sessions", json={"session_id": f"w{i}"}).status_code == 201
                turn(c, f"w{i}", first_text(i))
        server.restart()  # a graceful stop flushes every page to disk; the arena starts empty
        cold: list[float] = []
        warm: list[float] = []
        loaded: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
        with server.client("warm-bench", timeout=600) as c:
            # The first disk load after a start spawns the page codec processes and warms the
            # engine's paths: a session of its own takes that, unmeasured.
            turn(c, f"w{n}", "Which word was last?")
            for i in range(0, n, 2):
                # Alternate which one goes first, so neither always follows the other.
                order = (
                    [("cold", i), ("warm", i + 1)] if (i // 2) % 2 == 0 else [("warm", i + 1), ("cold", i)]
                )
                for kind, j in order:
                    sid = f"w{j}"
                    resident = c.get(f"/v1/sessions/{sid}/versions/1").json()["resident"]
                    if kind == "warm":
                        r = c.post(f"/v1/sessions/{sid}/warm")
                        assert r.status_code == 202, r.text
                        time.sleep(args.typing_s)  # the user types
                    else:
                        time.sleep(args.typing_s)  # the same pause, without the warm-up
                    ttft, info = turn(c, sid, "Which word was last?")
                    (warm if kind == "warm" else cold).append(ttft)
                    loaded[kind].append(info.get("loaded_from", {}))
                    print(
                        f"{kind:>4} {sid}: resident before {resident}, ttft {ttft * 1000:.0f} ms, "
                        f"loaded_from {info.get('loaded_from')}"
                    )
        cold_ms, warm_ms = statistics.median(cold) * 1000, statistics.median(warm) * 1000
        print(f"median ttft: cold disk {cold_ms:.0f} ms, warmed {warm_ms:.0f} ms")
        print(
            f"RESULT warm_vs_cold_disk={warm_ms / cold_ms:.3f} ttft_cold_ms={cold_ms:.0f} "
            f"ttft_warm_ms={warm_ms:.0f} sessions={n} typing_s={args.typing_s}"
        )
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
