"""How much of a chat's history each later turn gets from cache, over HTTP on the real server.

Starts `dss serve` (real vLLM CPU engine, the default model) in a temp data directory and
runs a natural multi-turn chat on a few sessions, round-robin: each turn sends the whole history
(`session_id` set, greedy) and asks for an answer of up to 200 tokens. For every later turn, the
history that could be reused is what the previous turn computed (its prompt and its answer but
the last sampled token, which has no KV yet); what was reused is `cached_tokens`.

  reuse             = tokens served from cache / reusable tokens, over turns >= 2 (goal >= 0.98)
  reuse_whole_pages = the same if only whole 128-token pages could be stored (computed from the
                      same turns; what the store served before it kept tail pages: 0.85 measured)

Ends with `RESULT reuse=... reuse_whole_pages=... turns=... sessions=...`.
Options: --sessions N (4), --turns N (5), --max-tokens N (200), --quick (2 sessions, 3 turns).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine_patch.setup.model import NOT_PREPARED  # noqa: E402
from tests.api_server import ApiServer, model_dir  # noqa: E402

BLOCK = 128
TOPICS = ["a week in Kyoto", "a small vegetable garden", "learning the violin", "a bakery's first year"]
FOLLOW_UPS = [
    "Give more detail on the second point.",
    "Now make it cheaper.",
    "What could go wrong, and how do I avoid it?",
    "Summarise everything so far as a checklist.",
    "Add one surprising idea.",
    "Rewrite it for a complete beginner.",
]


def turn(client: httpx.Client, sid: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    body = {"messages": messages, "session_id": sid, "temperature": 0, "max_tokens": max_tokens}
    r = client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.turns = 2, 3
    model = model_dir()
    if model is None:
        raise SystemExit(NOT_PREPARED)
    root = Path(tempfile.mkdtemp(prefix="dss-reuse-"))
    server = ApiServer(model, root, env={"DSS_ENGINE__MAX_MODEL_LEN": "4096"})
    server.start()
    try:
        client = server.client("reuse-bench", timeout=600)
        histories = {
            f"reuse-{i}": [{"role": "user", "content": f"Plan {TOPICS[i % len(TOPICS)]}, step by step."}]
            for i in range(args.sessions)
        }
        last: dict[str, dict[str, Any]] = {}
        reusable = served = whole_pages = 0
        columns = ("turn", "session", "prompt", "answer", "reusable", "cached", "loaded")
        print(" ".join(f"{c:>9}" for c in columns))
        n_later = 0
        for t in range(args.turns):
            for sid, messages in histories.items():
                resp = turn(client, sid, messages, args.max_tokens)
                usage = resp["usage"]
                cached = int(usage["prompt_tokens_details"]["cached_tokens"])
                prev = last.get(sid)
                could = prev["usage"]["prompt_tokens"] + prev["usage"]["completion_tokens"] - 1 if prev else 0
                if prev is not None:
                    n_later += 1
                    reusable += could
                    served += min(cached, could)
                    whole_pages += could // BLOCK * BLOCK
                row = (t + 1, sid, usage["prompt_tokens"], usage["completion_tokens"], could, cached)
                print(" ".join(f"{c:>9}" for c in (*row, resp["dss"]["loaded_tokens"])))
                last[sid] = resp
                answer = resp["choices"][0]["message"]["content"]
                follow = FOLLOW_UPS[(t + len(sid)) % len(FOLLOW_UPS)]
                histories[sid] = [
                    *messages,
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": follow},
                ]
        reuse = served / reusable if reusable else float("nan")
        pages_only = whole_pages / reusable if reusable else float("nan")
        print(f"later turns: {n_later}, reusable tokens {reusable}, served from cache {served}")
        print(
            f"RESULT reuse={reuse:.4f} reuse_whole_pages={pages_only:.4f} turns={n_later} "
            f"sessions={args.sessions}"
        )
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
