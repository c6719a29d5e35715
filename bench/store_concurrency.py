"""Store concurrency benchmark: lookup latency while the disk writer drains a backlog, then a stress run.

Real-sized pages: SmolLM2-135M in bf16 (30 layers, 3 KV heads, head size 64, block 128: 2,949,120 B
a page), with the bytes of /work/shared/data/kv_sample.bin (4 real pages, reused round-robin under
distinct token ids). fsync on, as in production.

Phases 1-2 run twice: page files encoded in the owner process, then in the codec process (the
default, `StoreConfig.codec_process`); the RESULT's first three keys are the latter's.

1. idle: p50/p99 of `store.kv.match` on a host-resident 4-page sequence, nothing else running (one
   lookup a millisecond, paced like the busy samples);
2. busy: the same lookups right after putting BACKLOG_PAGES fresh pages, while the write-through
   backlog drains (only samples taken before flush() returned count);
3. stress: tests.store_helpers.run_stress (tiny tiers, 4 workers, erasures) for N seconds.

A watchdog ends the process (exit status 1) after WATCHDOG_S without progress, still printing the
RESULT line with hangs=1, so the bench never hangs forever.

    .venv/bin/python bench/store_concurrency.py [--seconds N] [--backlog-pages N]

Last line: RESULT lookup_p99_busy_ms=… lookup_p99_idle_ms=… busy_vs_idle=… ops=… hangs=… errors=…
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dss.namespace import ModelFingerprint
from tests.store_helpers import open_store, open_stress_store, put_sequence, run_stress, thread_stacks

SAMPLE = (
    next(
        (p for p in (Path(__file__).resolve().parents[2] / "shared", Path("/work/shared")) if p.exists()),
        Path("/work/shared"),
    )
    / "data"
    / "kv_sample.bin"
)
FP = ModelFingerprint(
    model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    revision="main",
    dtype="bfloat16",
    num_layers=30,
    num_kv_heads=3,
    head_size=64,
    block_size=128,
)
WATCHDOG_S = float(os.environ.get("DSS_BENCH_WATCHDOG_S", "30"))
IDLE_SAMPLES = 300
PAGES_PER_SEQ = 4


class _State:
    progress = time.monotonic()
    phase = "start"
    busy = float("nan")
    idle = float("nan")


state = _State()


def result_line(ops: int, hangs: int, errors: int, in_process_ratio: float = float("nan")) -> str:
    busy, idle = state.busy, state.idle
    ratio = busy / idle if idle and idle == idle and busy == busy else float("nan")
    return (
        f"RESULT lookup_p99_busy_ms={busy:.3f} lookup_p99_idle_ms={idle:.3f} busy_vs_idle={ratio:.1f} "
        f"ops={ops} hangs={hangs} errors={errors} busy_vs_idle_in_process={in_process_ratio:.1f}"
    )


def watchdog() -> None:
    while True:
        time.sleep(0.5)
        if state.phase != "stress" and time.monotonic() - state.progress > WATCHDOG_S:
            print(f"HANG in phase {state.phase}: no progress for {WATCHDOG_S:.0f} s", flush=True)
            print(thread_stacks(), file=sys.stderr, flush=True)
            print(result_line(0, 1, 0), flush=True)
            os._exit(1)


def load_pages(path: Path) -> list[bytes]:
    shape = json.loads(path.with_suffix(".json").read_text())["shape"]
    arr = np.fromfile(path, dtype=np.uint8).reshape(shape[0], shape[1], -1)
    pages = [np.ascontiguousarray(arr[:, b]).tobytes() for b in range(shape[1])]
    assert all(len(p) == FP.page_nbytes for p in pages), (len(pages[0]), FP.page_nbytes)
    return pages


def pct_ms(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else float("nan")


def lookup_phase(data_dir: Path, backlog_pages: int, codec_process: bool) -> tuple[float, float]:
    """(idle p99, busy p99) in ms."""
    print(f"-- page files encoded {'in a codec process' if codec_process else 'in the owner process'}")
    real = load_pages(SAMPLE)
    n_seqs = backlog_pages // PAGES_PER_SEQ + 1
    store = open_store(
        data_dir,
        fsync=True,
        host_capacity_bytes=(n_seqs + 2) * PAGES_PER_SEQ * FP.page_nbytes,
        codec_process=codec_process,
    )
    fid = store.fingerprints.register(FP)
    tenant = store.identity.tenant_for("bench")
    flush = store.flush
    n_tok = PAGES_PER_SEQ * FP.block_size
    hot = np.arange(1, n_tok + 1, dtype=np.int32)
    put_sequence(store, fid, tenant, hot, real[:PAGES_PER_SEQ])
    flush()
    assert store.kv.match(fid, tenant, hot).n_tokens == n_tok

    state.phase = "idle"
    idle: list[float] = []
    for _ in range(IDLE_SAMPLES):
        t0 = time.perf_counter()
        store.kv.match(fid, tenant, hot)
        idle.append(time.perf_counter() - t0)
        state.progress = time.monotonic()
        time.sleep(0.001)  # the same pacing as the busy samples below
    state.idle = pct_ms(idle, 99)
    print(f"idle lookups: n={len(idle)} p50={pct_ms(idle, 50):.3f} ms p99={state.idle:.3f} ms", flush=True)

    state.phase = "put backlog"
    t0 = time.perf_counter()
    for s in range(n_seqs - 1):
        toks = np.arange(1, n_tok + 1, dtype=np.int32) + (s + 1) * 1_000_000
        put_sequence(store, fid, tenant, toks, [real[i % len(real)] for i in range(PAGES_PER_SEQ)])
        state.progress = time.monotonic()
    put_s = time.perf_counter() - t0
    state.phase = "busy"
    drained = threading.Event()
    t_flush = time.perf_counter()

    def drain() -> None:
        flush()
        drained.set()

    flusher = threading.Thread(target=drain, daemon=True)
    flusher.start()
    busy: list[float] = []
    while not drained.is_set():
        t0 = time.perf_counter()
        store.kv.match(fid, tenant, hot)
        dt = time.perf_counter() - t0
        if not drained.is_set():
            busy.append(dt)
        state.progress = time.monotonic()
        time.sleep(0.001)
    drain_s = time.perf_counter() - t_flush
    state.busy = pct_ms(busy, 99)
    mb = (n_seqs - 1) * PAGES_PER_SEQ * FP.page_nbytes / 1e6
    print(
        f"backlog: {(n_seqs - 1) * PAGES_PER_SEQ} pages ({mb:.0f} MB) put in {put_s:.2f} s, "
        f"drained in {drain_s:.2f} s",
        flush=True,
    )
    print(
        f"busy lookups: n={len(busy)} p50={pct_ms(busy, 50):.3f} ms p99={state.busy:.3f} ms "
        f"max={max(busy, default=0) * 1e3:.1f} ms",
        flush=True,
    )
    state.phase = "close"
    store.close()
    return state.idle, state.busy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("DSS_BENCH_SECONDS", "30")))
    ap.add_argument("--backlog-pages", type=int, default=96)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (the suite runs this)")
    args = ap.parse_args()
    if args.smoke:
        args.seconds, args.backlog_pages = 2.0, 8
    print(
        f"cores={os.cpu_count()} loadavg={' '.join(f'{x:.2f}' for x in os.getloadavg())} "
        f"page_nbytes={FP.page_nbytes}",
        flush=True,
    )
    threading.Thread(target=watchdog, name="bench-watchdog", daemon=True).start()
    with tempfile.TemporaryDirectory(prefix="dss-bench-conc-") as tmp:
        # The same measurement with page files encoded in the owner process (GIL shared with the
        # lookups), then with the codec process (the default), side by side in one run.
        idle_inproc, busy_inproc = lookup_phase(Path(tmp) / "inproc", args.backlog_pages, False)
        lookup_phase(Path(tmp) / "lookup", args.backlog_pages, True)
        state.phase = "stress"
        store = open_stress_store(Path(tmp) / "stress")
        report = run_stress(store, seconds=args.seconds, watchdog_s=min(WATCHDOG_S, 20.0))
        errors = sum(report.error_kinds.values()) + len(report.mismatches)
        print(
            f"stress: {report.ops} ops ({report.erases} erasures) in {args.seconds:.0f} s, "
            f"hang={f'yes after {report.hang_after_s:.1f} s' if report.hung else 'no'}, errors={errors}",
            flush=True,
        )
        for kind, n in report.error_kinds.most_common(5):
            print(f"  {n} x {kind}", flush=True)
        for m in report.mismatches[:5]:
            print(f"  wrong page: {m}", flush=True)
        if report.hung:
            print(report.stacks, file=sys.stderr, flush=True)
        if not report.hung:
            store.close()
        print(f"loadavg={' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        print(result_line(report.ops, int(report.hung), errors, busy_inproc / idle_inproc), flush=True)
        if report.hung:
            os._exit(1)  # deadlocked store threads would block interpreter exit
        store.close()


if __name__ == "__main__":
    main()
