"""The served dtype, bfloat16 vs float32 vs float16, side by side: answers, latency and page cost.

For each dtype, one engine with the DSS connector and vLLM's prefix caching, as `dss serve` runs
it, on one store shared by all of them (so each engine meets the pages of the ones before):

- sanity: the `engine_patch.setup.sanity` set through the chat template, greedy, one batch;
- TTFT cold: a fresh ~1000-token prompt (vLLM's cache emptied, no session), median of REPS;
- TTFT hot: the same prompt with its pages loaded from DSS's host tier (vLLM's cache emptied),
  and with vLLM's own prefix cache (APC) right after, medians of REPS;
- decode: tokens/s of a 128-token greedy generation (`ignore_eos`) after a cached prompt;
- KV page: the bytes of one stored page (one 128-token block of every layer) and the
  `zstd-byteplane` ratio (raw / compressed) of the real pages of that prompt, as the store
  encodes them (2-byte planes, `encode_page`'s default) and with planes of the element size;
- fingerprints: no engine may load the pages another dtype stored (the fingerprint
  holds the dtype, so another dtype's pages are never matched).

All engines are started first and every measurement is taken interleaved (bf16, fp32, fp16,
bf16, ...), one request at a time, so machine noise hits each dtype alike; an idle engine does not
compute. Compare the ratios of one run; absolute times vary with the machine's load.

    .venv/bin/python bench/served_dtype.py [--reps N] [--dtypes bfloat16,float32,float16]

Last line: RESULT sanity_bf16=… sanity_fp32=… ttft_cold_ratio_fp32=… ttft_hot_ratio_fp32=… (each dtype /
bfloat16) … page_bytes_ratio_fp32=… compress_bf16=… compress_fp32=… foreign_pages_loaded=0 passing=…
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _engine_common import (
    BS,
    ServedStore,
    TimedEngine,
    header,
    median,
    ms,
    ratio,
    session_params,
    text_of_tokens,
)

from dss.namespace import ModelFingerprint
from dss.pages.codec import BytePlaneZstdCodec
from dss.types import FingerprintId
from engine_patch.setup.sanity import DEFAULT_MIN_CORRECT, SANITY_SET, SanityReport, ask, score
from tests.store_helpers import load_sequence

CONTEXT_TOKENS = 1000
DECODE_TOKENS = 128
SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


@dataclass
class Side:
    """One dtype's engine and what was measured on it."""

    dtype: str
    engine: TimedEngine
    fid: FingerprintId
    fp: ModelFingerprint
    sanity: SanityReport
    cold: list[float] = field(default_factory=list)
    hot: list[float] = field(default_factory=list)
    apc: list[float] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)
    reused: tuple[int, int] = (0, 0)
    page_bytes: int = 0
    compress_2: float = float("nan")
    compress_elem: float = float("nan")
    foreign_loaded: int = 0  # tokens this engine loaded of the pages another dtype stored

    @property
    def short(self) -> str:
        return SHORT.get(self.dtype, self.dtype)


def shared_prompt(engine: TimedEngine) -> list[int]:
    return engine.chat_ids([{"role": "user", "content": "Shared context: " + "river stone " * 300}])


def decode_rate(engine: TimedEngine, prompt: list[int]) -> float:
    """Generated tokens per second after the first token (prompt already in vLLM's cache)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    (o,) = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)], [params], use_tqdm=False)
    wall = time.perf_counter() - t0
    ttft = getattr(getattr(o, "metrics", None), "first_token_latency", 0.0) or 0.0
    n = len(o.outputs[0].token_ids)
    return (n - 1) / (wall - ttft) if ttft > 0 else n / wall


def kv_cache_dtype_support() -> str:
    """What the CPU attention backend accepts as a KV cache dtype other than the model's."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return ",".join(CPUAttentionBackend.supported_kv_cache_dtypes)


def start(dtype: str, served: ServedStore) -> Side:
    known = set(served.store.fingerprints)
    t0 = time.monotonic()
    engine = TimedEngine(served.address, served.authkey, dtype=dtype, enable_prefix_caching=True)
    try:
        started = time.monotonic() - t0
        report = score(dtype, SANITY_SET, ask(engine.llm))
        print(f"[{dtype}] started in {started:.0f} s; {report.summary()}", flush=True)
        for q, a in report.wrong:
            print(f"[{dtype}]   wrong: {q.text!r} -> {a[:70]!r}", flush=True)
        engine.warm_up()
        (fid,) = set(served.store.fingerprints) - known
    except BaseException:
        engine.close()
        raise
    return Side(dtype, engine, fid, served.store.fingerprints.get(fid), report)


def store_and_load(side: Side, served: ServedStore, prompt: list[int], sid: str) -> tuple[int, int]:
    """Store `prompt`'s pages in session `sid` with this engine; wait until they are in the host
    tier. Returns (tokens loaded by the storing request, whole pages stored)."""
    tenant = served.store.identity.tenant_for("dtype-user")
    sess = session_params(served.authkey, tenant, sid)
    before = served.host_pages()
    first = side.engine.timed(prompt, sess, reset=True).result
    stored = int((first.params or {}).get("stored_pages", 0))
    if not stored:
        raise RuntimeError(f"[{side.dtype}] the pages of {sid} were not stored: {first.params}")
    if not served.wait_for_host_pages(side.engine, before + stored, timeout_s=30):
        raise RuntimeError(f"[{side.dtype}] the pages of {sid} never reached the host tier")
    return first.loaded_tokens, stored


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtypes", default="bfloat16,float32,float16")
    args = parser.parse_args()
    header("served_dtype")
    print(f"CPU backend KV cache dtypes: {kv_cache_dtype_support()} (besides the model's own)", flush=True)
    served = ServedStore(host_gib=0.5)
    sides: list[Side] = []
    codec = BytePlaneZstdCodec()
    try:
        for dtype in args.dtypes.split(","):
            sides.append(start(dtype, served))
        tenant = served.store.identity.tenant_for("dtype-user")

        # One prompt, one session, one tenant, asked by every engine in turn: none may load what
        # another dtype stored (the fingerprints differ); each loads its own pages afterwards.
        for side in sides:
            prompt = shared_prompt(side.engine)
            side.foreign_loaded, _ = store_and_load(side, served, prompt, "shared-session")
            sess = session_params(served.authkey, tenant, "shared-session")
            if not side.engine.timed(prompt, sess, reset=True).result.loaded_tokens:
                raise RuntimeError(f"[{side.dtype}] the engine loaded none of its own pages")

        rng = np.random.default_rng(11)
        for _ in range(args.reps):
            text = text_of_tokens(rng, CONTEXT_TOKENS)
            for side in sides:
                c = side.engine.timed(
                    side.engine.chat_ids([{"role": "user", "content": text}]), None, reset=True
                )
                if c.result.num_cached_tokens:
                    raise RuntimeError(f"a cold run reused {c.result.num_cached_tokens} tokens")
                side.cold.append(c.ttft_s)

        text = text_of_tokens(rng, CONTEXT_TOKENS)
        prompts = {side.dtype: side.engine.chat_ids([{"role": "user", "content": text}]) for side in sides}
        for side in sides:
            store_and_load(side, served, prompts[side.dtype], f"hot-{side.dtype}")
        for _ in range(args.reps):
            for side in sides:
                prompt = prompts[side.dtype]
                reuse = ((len(prompt) - 1) // BS) * BS
                sess = session_params(served.authkey, tenant, f"hot-{side.dtype}")
                h = side.engine.timed(prompt, sess, reset=True)
                a = side.engine.timed(prompt, None)
                if h.result.loaded_tokens < reuse or a.result.num_cached_tokens < reuse:
                    raise RuntimeError(
                        f"[{side.dtype}] hot loaded {h.result.loaded_tokens}, APC reused "
                        f"{a.result.num_cached_tokens}; expected at least {reuse}"
                    )
                side.reused = (h.result.loaded_tokens, a.result.num_cached_tokens)
                side.hot.append(h.ttft_s)
                side.apc.append(a.ttft_s)
        for _ in range(max(2, args.reps // 2)):
            for side in sides:
                side.decode_tps.append(decode_rate(side.engine, prompts[side.dtype]))

        for side in sides:
            n, pages = load_sequence(served.store, side.fid, tenant, prompts[side.dtype])
            pages = pages[: n // BS]  # whole blocks only
            if not pages:
                raise RuntimeError(f"[{side.dtype}] the store returned no whole page")
            elem = 4 if side.fp.dtype == "float32" else 2
            raw = sum(len(p) for p in pages)
            side.page_bytes = len(pages[0])
            side.compress_2 = raw / sum(len(codec.encode(p, 2)) for p in pages)
            side.compress_elem = raw / sum(len(codec.encode(p, elem)) for p in pages)
            for p in pages:  # lossless, whatever the plane width
                assert bytes(codec.decode(codec.encode(p, elem), len(p), elem)) == bytes(p)
        served.store.check()
    finally:
        for side in sides:
            side.engine.close()
        served.close()

    for m in sides:
        print(
            f"[{m.dtype}] fingerprint {m.fid[:12]} dtype={m.fp.dtype} isa={m.fp.isa}; cold {ms(m.cold)}; "
            f"DSS hot {ms(m.hot)}; APC {ms(m.apc)} (reused {m.reused}); "
            f"decode {[round(x, 1) for x in m.decode_tps]} tok/s; page {m.page_bytes} B, zstd-byteplane "
            f"x{m.compress_2:.3f} (2-byte planes), x{m.compress_elem:.3f} (element planes); "
            f"loaded of other dtypes' pages: {m.foreign_loaded}"
        )
    print(f"loadavg at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    out: dict[str, str] = {f"sanity_{m.short}": f"{m.sanity.correct}/{m.sanity.total}" for m in sides}
    base = next((m for m in sides if m.dtype == "bfloat16"), sides[0])
    for m in sides:
        if m is base:
            continue
        s = m.short  # ratios: this dtype / the bfloat16 baseline
        out[f"ttft_cold_ratio_{s}"] = f"{ratio(median(m.cold), median(base.cold)):.3f}"
        out[f"ttft_hot_ratio_{s}"] = f"{ratio(median(m.hot), median(base.hot)):.3f}"
        out[f"ttft_apc_ratio_{s}"] = f"{ratio(median(m.apc), median(base.apc)):.3f}"
        out[f"decode_ratio_{s}"] = f"{ratio(median(m.decode_tps), median(base.decode_tps)):.3f}"
        out[f"page_bytes_ratio_{s}"] = f"{ratio(m.page_bytes, base.page_bytes):.3f}"
    for m in sides:
        s = m.short
        out[f"ttft_cold_{s}_ms"] = f"{1000 * median(m.cold):.0f}"
        out[f"ttft_hot_{s}_ms"] = f"{1000 * median(m.hot):.0f}"
        out[f"decode_{s}_tps"] = f"{median(m.decode_tps):.1f}"
        out[f"page_bytes_{s}"] = str(m.page_bytes)
        out[f"compress_{s}"] = f"{m.compress_2:.3f}"
        out[f"compress_{s}_elem_planes"] = f"{m.compress_elem:.3f}"
    out["foreign_pages_loaded"] = str(sum(m.foreign_loaded for m in sides))
    passing = [m.short for m in sides if m.sanity.correct >= DEFAULT_MIN_CORRECT]
    out["passing"] = ",".join(passing) or "none"
    print("RESULT " + " ".join(f"{k}={v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
