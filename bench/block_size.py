"""The engine block size on CPU, 128 (vLLM's CPU default) against 64, 32 and 16: prefill and
decode speed, and the bytes of one page (one block of every layer) each block size stores.

DSS stores the partial last block of every sequence as a tail page, so the block size no longer
decides how much history is reused; what it still decides is the speed of the attention kernel
(it walks the KV cache block by block) and the store's bookkeeping per token (a page per block:
a smaller block means more pages, index entries and copies per token).

Each block size runs in a fresh subprocess (one engine at a time: two would share two cores),
plain vLLM as the project builds it (`engine_patch.setup.factory.build_llm` without the DSS connector),
prefix caching off, `VLLM_CPU_KVCACHE_SPACE=1`, the project's default dtype
(`EngineSettings.dtype`) unless `--dtype` says otherwise:

- prefill: the wall time of a ~1000-token prompt with `max_tokens=1`, 3 distinct prompts after
  one warm-up (the same prompts for every block size);
- decode: tokens/s of a 128-token greedy generation (`ignore_eos`) after a 512-token prompt,
  batch of 1 and of 4, from vLLM's engine-core timestamps (first to last token of each request);
- page bytes: `frontend_fingerprint(...).page_nbytes`
  (2 * layers * kv_heads * head_dim * dtype_bytes * block_size).

Rounds interleave the block sizes (the order rotates each round), and ratios are taken within a
round then the median across rounds, so a load change on a shared machine hits every block size
alike. A block size the CPU attention backend rejects is reported with the one-line reason.

    .venv/bin/python bench/block_size.py [--rounds N] [--block-sizes 128,64,32,16] [--dtype D] [--quick]

Last line: RESULT prefill_64_vs_128=… prefill_32_vs_128=… decode_64_vs_128=… decode_32_vs_128=…
block16=supported|unsupported chosen=…
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _engine_common import header, median, ratio, root_cause, text_of_tokens

PROMPT_TOKENS = 1000
DECODE_TOKENS = 128
DECODE_CONTEXT = 512  # prompt tokens before the decode (a batch of 4 prefills 4x this first)
PREFILL_PROMPTS = 3
BATCHES = (1, 4)
TOLERANCE = 0.03  # a smaller block must be faster than this to pay for its extra pages
CHILD_TIMEOUT_S = 600


# ---------------------------------------------------------------- the child: one engine


def _prompts(tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = tokenizer(text_of_tokens(rng, int(PROMPT_TOKENS * 1.1)), add_special_tokens=False)["input_ids"]
        if len(ids) < PROMPT_TOKENS:
            raise RuntimeError(f"a prompt has {len(ids)} tokens, expected at least {PROMPT_TOKENS}")
        out.append([int(t) for t in ids[:PROMPT_TOKENS]])
    return out


def _prefill_s(llm: Any, prompt: list[int]) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.perf_counter()
    (o,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], [params], use_tqdm=False)
    wall = time.perf_counter() - t0
    if int(o.num_cached_tokens or 0):
        raise RuntimeError(f"prefix caching is off, yet {o.num_cached_tokens} tokens were cached")
    return wall


def _decode_tps(llm: Any, prompts: list[list[int]], tokens: int) -> tuple[float, float]:
    """(tokens/s of the batch, wall seconds): each request's decode interval is its engine-core
    time from the first to the last token over the tokens after the first; the batch's rate is the
    sum of the requests' rates (they decode in the same steps)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(inputs, [params] * len(inputs), use_tqdm=False)
    wall = time.perf_counter() - t0
    rate = 0.0
    for o in outs:
        n = len(o.outputs[0].token_ids)
        if n != tokens:
            raise RuntimeError(f"generated {n} tokens, expected {tokens} (ignore_eos)")
        m = o.metrics
        span = (m.last_token_ts - m.first_token_ts) if m is not None else 0.0
        if span <= 0:
            raise RuntimeError("vLLM reported no token timestamps (disable_log_stats must be False)")
        rate += (n - 1) / span
    return rate, wall


def child(block_size: int, dtype: str, out_path: Path, decode_tokens: int, prefill_prompts: int) -> None:
    from engine_patch.connector.fingerprint import frontend_fingerprint
    from engine_patch.setup.factory import build_llm
    from tests.engine_helpers import settings

    s = settings(
        block_size=block_size,
        dtype=dtype,
        enable_prefix_caching=False,
        connector=False,
        kv_cache_space_gib=1,
        extra_engine_args={"disable_log_stats": False},
    )
    t0 = time.monotonic()
    llm = build_llm(None, None, s)
    start_s = time.monotonic() - t0
    try:
        config = llm.llm_engine.vllm_config
        fp = frontend_fingerprint(config)
        if fp.block_size != block_size:
            raise RuntimeError(f"asked for block size {block_size}, the engine runs {fp.block_size}")
        tok = llm.get_tokenizer()
        warm, *prompts = _prompts(tok, 1 + prefill_prompts + max(BATCHES), seed=20261201)
        _prefill_s(llm, warm)
        _decode_tps(llm, [warm], 8)
        prefill = [_prefill_s(llm, p) for p in prompts[:prefill_prompts]]
        decode = {}
        for b in BATCHES:
            decode[str(b)] = _decode_tps(llm, [p[:DECODE_CONTEXT] for p in prompts[:b]], decode_tokens)[0]
        result = {
            "block_size": block_size,
            "dtype": fp.dtype,
            "isa": fp.isa,
            "page_bytes": fp.page_nbytes,
            "prefill_s": prefill,
            "decode_tps": decode,
            "start_s": start_s,
            "num_blocks": int(config.cache_config.num_gpu_blocks or 0),
        }
    finally:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()
    out_path.write_text(json.dumps(result))


# ---------------------------------------------------------------- the parent: rounds, table


@dataclass
class PerBlock:
    block_size: int
    unsupported: str | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)

    def prefill(self) -> float:
        return median([x for r in self.rounds for x in r["prefill_s"]])

    def decode(self, b: int) -> float:
        return median([r["decode_tps"][str(b)] for r in self.rounds])


def run_child(bs: int, dtype: str, work: Path, rnd: int, decode_tokens: int, prompts: int) -> dict | str:
    """The child's result, or the one-line reason it failed."""
    out = work / f"bs{bs}-r{rnd}.json"
    log = work / f"bs{bs}-r{rnd}.log"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        str(bs),
        "--dtype",
        dtype,
        "--out",
        str(out),
        "--decode-tokens",
        str(decode_tokens),
        "--prompts",
        str(prompts),
    ]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    with log.open("wb") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=CHILD_TIMEOUT_S)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {CHILD_TIMEOUT_S} s"
    if rc == 0 and out.exists():
        return json.loads(out.read_text())
    lines = log.read_text(errors="replace").splitlines()
    reason = root_cause(lines, RuntimeError(f"exit status {rc}, no result (log: {log})"))
    return reason.replace("\n", " ")


def fmt_ratio(x: float) -> str:
    return "nan" if x != x else f"{x:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--block-sizes", default="128,64,32,16")
    parser.add_argument("--dtype", default=None, help="default: the project's EngineSettings.dtype")
    parser.add_argument("--quick", action="store_true", help="1 round, 32 decode tokens, 2 prompts")
    parser.add_argument("--keep", type=Path, default=None, help="keep the children's logs here")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=int, default=PREFILL_PROMPTS, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child is not None:
        assert args.out is not None and args.dtype is not None
        child(args.child, args.dtype, args.out, args.decode_tokens, args.prompts)
        return

    from tests.engine_helpers import settings

    dtype = args.dtype or settings().dtype
    rounds, decode_tokens, prompts = args.rounds, args.decode_tokens, args.prompts
    if args.quick:
        rounds, decode_tokens, prompts = 1, 32, 2
    sizes = [int(x) for x in args.block_sizes.split(",")]
    if 128 not in sizes:
        sizes.insert(0, 128)
    header("block_size")
    print(
        f"dtype={dtype} rounds={rounds} prompt={PROMPT_TOKENS} tokens, prefill prompts={prompts}, "
        f"decode {decode_tokens} tokens, batches {BATCHES}, prefix caching off",
        flush=True,
    )
    per = {bs: PerBlock(bs) for bs in sizes}
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dss-block-size-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for rnd in range(rounds):
            order = sizes[rnd % len(sizes) :] + sizes[: rnd % len(sizes)]
            for bs in order:
                p = per[bs]
                if p.unsupported is not None:
                    continue
                t0 = time.monotonic()
                r = run_child(bs, dtype, work, rnd, decode_tokens, prompts)
                if isinstance(r, str):
                    p.unsupported = r
                    print(f"[bs={bs} round {rnd}] unsupported: {r}", flush=True)
                    continue
                r["round"] = rnd
                p.rounds.append(r)
                dec = " ".join(f"b{b}={r['decode_tps'][str(b)]:.1f}" for b in BATCHES)
                print(
                    f"[bs={bs} round {rnd}] isa={r['isa']} start {r['start_s']:.0f} s; prefill "
                    f"{[round(1000 * x) for x in r['prefill_s']]} ms; decode tok/s {dec}; "
                    f"{time.monotonic() - t0:.0f} s, loadavg {os.getloadavg()[0]:.1f}",
                    flush=True,
                )

    base = per[128]
    if not base.rounds:
        raise SystemExit(f"block size 128 did not run: {base.unsupported}")

    def paired(bs: int, metric: str) -> float:
        """Median over rounds of this block size's value / 128's in the same round."""
        base_by_round = {r["round"]: r for r in base.rounds}
        xs = []
        for r in per[bs].rounds:
            b = base_by_round.get(r["round"])
            if b is None:
                continue
            if metric == "prefill":
                xs.append(ratio(median(r["prefill_s"]), median(b["prefill_s"])))
            else:
                xs.append(ratio(r["decode_tps"][metric], b["decode_tps"][metric]))
        return median(xs)

    print()
    print(
        "| block | ISA | page bytes | pages / 1k tokens | prefill 1k (ms) | vs 128 | decode b1 (tok/s) "
        "| vs 128 | decode b4 (tok/s) | vs 128 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios: dict[int, dict[str, float]] = {}
    for bs in sizes:
        p = per[bs]
        if not p.rounds:
            print(f"| {bs} | unsupported: {p.unsupported} | | | | | | | | |")
            continue
        r0 = p.rounds[0]
        q = {"prefill": paired(bs, "prefill"), **{str(b): paired(bs, str(b)) for b in BATCHES}}
        ratios[bs] = q
        print(
            f"| {bs} | {r0['isa']} | {r0['page_bytes']:,} | {-(-PROMPT_TOKENS // bs)} "
            f"| {1000 * p.prefill():.0f} | {fmt_ratio(q['prefill'])} "
            f"| {p.decode(1):.1f} | {fmt_ratio(q['1'])} | {p.decode(4):.1f} | {fmt_ratio(q['4'])} |"
        )
    print(f"(total {time.monotonic() - t_start:.0f} s)")

    # The smallest block size not slower than 128 on any measure (within TOLERANCE) and faster by
    # more than TOLERANCE on at least one: a tie keeps 128, since a smaller block costs the store
    # 128/bs times the pages (index entries, copies, checksums) per token.
    chosen = 128
    for bs in sorted(ratios):
        if bs >= 128:
            continue
        q = ratios[bs]
        speedups = [1 / q["prefill"], *(q[str(b)] for b in BATCHES)]  # > 1: faster than 128
        if all(s >= 1 - TOLERANCE for s in speedups) and any(s > 1 + TOLERANCE for s in speedups):
            chosen = bs
            break

    def r(bs: int, key: str) -> str:
        return fmt_ratio(ratios.get(bs, {}).get(key, float("nan")))

    b16 = "untested" if 16 not in per else "supported" if per[16].rounds else "unsupported"
    print(
        "# prefill_*: time ratio (bs / 128, > 1 slower); "
        "decode_* / decode4_*: throughput ratio, batch 1 / 4 (bs / 128, < 1 slower)"
    )
    print(
        f"RESULT prefill_64_vs_128={r(64, 'prefill')} prefill_32_vs_128={r(32, 'prefill')} "
        f"decode_64_vs_128={r(64, '1')} decode_32_vs_128={r(32, '1')} "
        f"decode4_64_vs_128={r(64, '4')} decode4_32_vs_128={r(32, '4')} "
        f"block16={b16} chosen={chosen}"
    )


if __name__ == "__main__":
    main()
