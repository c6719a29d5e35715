"""Cold turns under concurrent load: what saving costs a turn nothing could be reused for.

Three servers on the same model and engine settings (`bench/peers.py`'s `EngineShape`: dtype,
context length, block size, KV space, CPU reservation), all up for the whole run:

- `dss`: `dss serve --dev`, every turn in a session of its own (`session_id`), so every prompt is
  saved (host tier, written through to disk);
- `uncached`: the same `dss serve --dev` with `DSS_ENGINE__KV_CACHING=false`: the same API and
  the same sessions, its engine without DSS's connector (vLLM's prefix cache on), so the
  difference is what the connector and the store cost;
- `vllm`: vLLM's own OpenAI server on the same engine, prefix cache on (what a client of plain
  vLLM sees: another API in front of the same engine).

Rounds rotate between them (dss, uncached, vllm, dss, ...). A round is `--sessions` first turns
of fresh chats (`--tokens` prompt tokens each, a new seed per round, so no prefix is shared with
anything seen before; the servers of one rotation get the same prompts), sent by `--concurrency`
clients at once through the official `openai` client, streamed, greedy, `--max-tokens` answer
tokens. Per round: the mean time to the first token and the round's wall time. A throwaway turn
per server first.

    .venv/bin/python bench/cold_concurrent.py                    # 32 x ~2k tokens, 4 at once, 2 rotations
    .venv/bin/python bench/cold_concurrent.py --quick            # 8 x ~1k tokens, 1 rotation

The last line is `RESULT cold_concurrent_vs_uncached= dss_ttft_s= uncached_ttft_s= vllm_ttft_s=
dss_round_s= uncached_round_s= vllm_round_s= cold_concurrent_vs_vllm=`: DSS's mean TTFT over
the same server's with the connector off, over all rounds (issue 31: goal <= 1.05), the absolute
means, and DSS's over vLLM's own server's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from _procs import model_dir  # noqa: E402
from peers import (  # noqa: E402
    REQUEST_TIMEOUT_S,
    USER,
    EngineShape,
    Turn,
    chat_turn,
    make_script,
    servers,
    start_dss,
    start_vllm,
)

# What every chat shares, at most: the template's opening (`<|im_start|>system\n`, a word or so).
# The store no longer loads it from another chat's tail page (`dss.ops.kv.loads.worth_loading`);
# a cold turn served more than this was not cold.
OPENING_TOKENS = 8
CONNECTOR_OFF = {"DSS_ENGINE__KV_CACHING": "false"}  # the same server, its engine without DSS's connector


def cold_round(base_url: str, prompts: list[str], concurrency: int, max_tokens: int, dss: bool,
               tag: str) -> tuple[list[Turn], float]:  # fmt: skip
    """Every prompt as the first turn of a new chat, `concurrency` at a time: the turns and the
    round's wall time."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="dev", default_headers={"X-DSS-User": USER},
                    timeout=REQUEST_TIMEOUT_S, max_retries=0)  # fmt: skip
    model = client.models.list().data[0].id

    def one(i: int) -> Turn:
        extra = {"session_id": f"{USER}-{tag}-{i}"} if dss else None
        # A system message of its own first: nothing before the prompt's words is shared either
        # (the template's default system message would be, with every chat of the user).
        messages = [
            {"role": "system", "content": f"Chat {tag}-{i}."},
            {"role": "user", "content": prompts[i]},
        ]
        turn, _ = chat_turn(client, model, messages, max_tokens, extra)
        if (turn.cached_tokens or 0) > OPENING_TOKENS:
            raise RuntimeError(f"a cold prompt was served {turn.cached_tokens} cached tokens: not cold")
        return turn

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        turns = list(pool.map(one, range(len(prompts))))
    return turns, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=None, help="cold turns per round (default 32; --quick: 8)")
    p.add_argument("--tokens", type=int, default=None, help="prompt tokens (default 2000; --quick: 1000)")
    p.add_argument("--concurrency", type=int, default=4, help="clients at once (default 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="answer tokens (default 16)")
    p.add_argument("--pairs", type=int, default=None, help="rounds of each server (default 2; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="a short run (a few minutes)")
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args()
    sessions = args.sessions or (8 if args.quick else 32)
    tokens = args.tokens or (1000 if args.quick else 2000)
    pairs = args.pairs or (1 if args.quick else 2)
    model = model_dir()
    if model is None:
        raise SystemExit("the default model is not prepared: run `make model` (or set DSS_MODEL_DIR)")
    shape = EngineShape.from_factory(model, REPO)
    print(f"cold_concurrent: {sessions} cold turns of ~{tokens} tokens per round, "
          f"{args.concurrency} at once, {pairs} rotation(s); engine {shape}; "
          f"loadavg {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    names = ("dss", "uncached", "vllm")
    ttft: dict[str, list[float]] = {n: [] for n in names}
    walls: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="dss-bench-cold-") as tmp, servers() as procs:
        root = Path(tmp)
        urls = {
            "dss": start_dss(procs, shape, model, root, REPO),
            "uncached": start_dss(procs, shape, model, root, REPO, "uncached", CONNECTOR_OFF),
            "vllm": start_vllm(procs, shape, model, root, "vllm", sys.executable, True),
        }
        for name, url in urls.items():  # one throwaway round of one turn each
            cold_round(url, ["Hello there, who are you?"], 1, 8, name != "vllm", f"warm-{name}")
        for pair in range(pairs):
            n = tokens - 8  # the chat template's few tokens on top
            prompts = make_script(sessions, 1, (n, n), (1, 1), args.seed + pair, model).first
            for name, url in urls.items():
                turns, wall = cold_round(url, prompts, args.concurrency, args.max_tokens, name != "vllm",
                                         f"r{pair}")  # fmt: skip
                ts = [t.ttft_s for t in turns]
                ttft[name] += ts
                walls[name].append(wall)
                print(f"  rotation {pair} {name:8s}: TTFT mean {1000 * np.mean(ts):6.0f} ms "
                      f"(median {1000 * np.median(ts):5.0f}, max {1000 * max(ts):5.0f}), "
                      f"round {wall:5.1f} s, "
                      f"prompt {np.mean([t.prompt_tokens for t in turns]):5.0f} tok, "
                      f"loadavg {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    dss, unc, plain = (float(np.mean(ttft[n])) for n in names)
    print(
        f"RESULT cold_concurrent_vs_uncached={dss / unc:.3f} dss_ttft_s={dss:.3f} uncached_ttft_s={unc:.3f} "
        f"vllm_ttft_s={plain:.3f} dss_round_s={np.mean(walls['dss']):.2f} "
        f"uncached_round_s={np.mean(walls['uncached']):.2f} vllm_round_s={np.mean(walls['vllm']):.2f} "
        f"cold_concurrent_vs_vllm={dss / plain:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
