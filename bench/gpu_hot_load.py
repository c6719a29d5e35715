"""A hot load on a CUDA device through DSS's copy path, against the bus and against a prefill.

What a hot turn costs the engine on a GPU once DSS's host tier holds the history: the pages go from
the pinned host arena into the engine's KV blocks (`engine_patch.connector.copy.KVBlocks` over
`cuda_copy.CudaCopier`: one DMA per run of consecutive slots, the layout conversion on the device).
Measured side by side in one run, for a Llama-3-8B-shaped KV cache (32 layers, 8 KV heads of 128,
bf16, blocks of 16, vLLM 0.32's FlashAttention layout LBNHC):
- `load`: the history's pages into free blocks in one run of consecutive blocks, and fragmented
  (every block its own run, in a shuffled order, as after the engine's cache has churned);
- `dma`: the same bytes in ONE plain host-to-device copy from the same pinned memory: the bus's
  own ceiling, which no load can beat;
- `save`: the blocks back into the arena (what a finished turn costs);
- `prefill`: the same number of tokens recomputed by a random-weight model of the same shape
  (transformers, SDPA attention, bf16), which is what the load replaces.
Every load is checked byte for byte against the blocks it came from (`exact=1`).

Without vLLM's CUDA build on the machine, this measures DSS's part of a hot turn, not a whole turn
through an engine (`bench/model_matrix.py` does that on CPU). Needs only torch (and transformers
for the prefill): `make test-gpu` runs it on a bare CUDA machine. Without CUDA it says so and exits;
`--smoke` runs tiny sizes on the CPU path instead (the suite's check that the script works).

Run: python bench/gpu_hot_load.py [--tokens 8192] [--reps 7] [--no-prefill] [--smoke]
Ends with: RESULT device= tokens= kv_mib= load_ms= load_gib_s= dma_gib_s= load_vs_dma=
fragmented_load_vs_dma= save_gib_s= prefill_ms= load_vs_prefill= exact=
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dss.pages.tiers.host import HostArena
from engine_patch.connector.copy import ArenaViews, KVBlocks, runs
from engine_patch.connector.layouts import VLLM_AXES, KVLayout
from tests.engine_patch.connector.kv_copies import engine_layers

GIB = 1 << 30


def timed(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    """Median seconds of `fn` over `reps` runs after one warm-up, the device drained around each."""
    times = []
    for i in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def same_blocks(src: list[torch.Tensor], blocks: list[int], dst: list[torch.Tensor], into: list[int]) -> bool:
    return all(torch.equal(s[blocks], d[into]) for s, d in zip(src, dst, strict=True))


def arena_dir(need: int) -> str:
    """/dev/shm when it has room (the store's own place), else the temporary directory."""
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > need * 1.2:
        return "/dev/shm"
    return tempfile.gettempdir()


def prefill_seconds(args: argparse.Namespace, device: str, reps: int, sync: Callable[[], None]) -> float:
    """A forward over `tokens` new tokens through a random-weight Llama of the KV cache's shape,
    hidden states for every token and logits for the last (what an engine's prefill computes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.heads * args.head_size,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_size,
        vocab_size=args.vocab,
        max_position_embeddings=max(args.tokens, 2048),
        attn_implementation="sdpa",
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(default)
    ids = torch.randint(0, args.vocab, (1, args.tokens), device=device)

    def forward() -> None:
        with torch.inference_mode():
            hidden = model.model(input_ids=ids).last_hidden_state
            model.lm_head(hidden[:, -1:])

    return timed(forward, reps, sync)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-prefill", action="store_true", help="skip the recompute (needs transformers)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, on the CPU when there is no CUDA")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if args.smoke:
        args.tokens, args.layers, args.kv_heads, args.heads, args.head_size = 256, 2, 2, 4, 16
        args.intermediate, args.vocab, args.reps = 128, 1000, 2
    elif not cuda:
        print("gpu_hot_load: no CUDA device here; `--smoke` runs the CPU path at tiny sizes")
        print("RESULT device=none")
        return
    device = "cuda" if cuda else "cpu"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    bs, n_layers = args.block_size, args.layers
    n_blocks = -(-args.tokens // bs)
    engine_blocks = 2 * n_blocks  # room for a fragmented placement
    src, dst = (
        engine_layers(
            "LBNHC",
            block_size=bs,
            heads=args.kv_heads,
            content=2 * args.head_size,
            layers=n_layers,
            blocks=engine_blocks,
            device=device,
            seed=None,
        )
        for _ in range(2)
    )
    for t in src:
        t.copy_(torch.randn(t.shape, device=device).to(t.dtype))
    layout = KVLayout(VLLM_AXES, engine_blocks)
    saver, loader = KVBlocks(src, layout), KVBlocks(dst, layout)
    slot_nbytes = n_layers * saver.layer_block_nbytes
    kv_bytes = n_blocks * slot_nbytes

    where = arena_dir(kv_bytes)
    with tempfile.TemporaryDirectory(dir=where) as private:
        path = Path(private) / "arena.shm"
        arena = HostArena.create(path, slot_nbytes, n_blocks)
        views = ArenaViews(n_layers, saver.layer_block_nbytes, pin=cuda)
        try:
            pages = views.pages(str(path), slot_nbytes)
            slots = list(range(n_blocks))
            history = list(range(n_blocks))  # the turn that wrote the history
            save_s = timed(lambda: saver.save(pages, runs(history, slots)), args.reps, sync)

            together = list(range(n_blocks, 2 * n_blocks))
            g = torch.Generator().manual_seed(0)
            scattered = [int(b) for b in torch.randperm(engine_blocks, generator=g)[:n_blocks]]
            load_s = timed(lambda: loader.load(pages, runs(together, slots)), args.reps, sync)
            exact = same_blocks(src, history, dst, together)
            fragmented_s = timed(lambda: loader.load(pages, runs(scattered, slots)), args.reps, sync)
            exact = exact and same_blocks(src, history, dst, scattered)

            flat = pages.view(-1)[:kv_bytes]
            bus = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
            dma_s = timed(lambda: bus.copy_(flat, non_blocking=True), args.reps, sync)
        finally:
            views.close()
            arena.close()
    del src, dst
    prefill_s = None if args.no_prefill else prefill_seconds(args, device, args.reps, sync)

    gib = kv_bytes / GIB
    fields = {
        "device": device,
        "tokens": args.tokens,
        "kv_mib": f"{kv_bytes / (1 << 20):.0f}",
        "load_ms": f"{load_s * 1e3:.2f}",
        "load_gib_s": f"{gib / load_s:.1f}",
        "dma_gib_s": f"{gib / dma_s:.1f}",
        "load_vs_dma": f"{load_s / dma_s:.2f}",
        "fragmented_load_vs_dma": f"{fragmented_s / dma_s:.2f}",
        "save_gib_s": f"{gib / save_s:.1f}",
    }
    if prefill_s is not None:
        fields["prefill_ms"] = f"{prefill_s * 1e3:.1f}"
        fields["load_vs_prefill"] = f"{load_s / prefill_s:.4f}"
    fields["exact"] = int(exact)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(
        f"{name}: {args.tokens} tokens, {gib:.3f} GiB of KV, arena in {where}; "
        f"load {load_s * 1e3:.2f} ms (fragmented {fragmented_s * 1e3:.2f} ms), "
        f"one plain DMA {dma_s * 1e3:.2f} ms, save {save_s * 1e3:.2f} ms"
        + (f", prefill {prefill_s * 1e3:.1f} ms" if prefill_s is not None else "")
    )
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()))
    if not exact:
        sys.exit("gpu_hot_load: a loaded block differs from the block it was saved from")


if __name__ == "__main__":
    main()
