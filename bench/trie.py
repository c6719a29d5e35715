"""Benchmark of the token radix trie at 10M indexed tokens (page_size 16).

Builds an index the way chat traffic fills one: a few hundred 32k-token sessions that share system
prompts, some forked from earlier sessions, each inserted turn by turn. Measures the median `match`
time of a present 32k-token prompt (and of one that diverges midway), insert throughput for new
32k-token sequences and index memory per token (tracemalloc over the build). Side by side, it times
the hash-chain lookup an engine would otherwise do (hash every page, probe a dict) on the same
prompt.

Run: .venv/bin/python bench/trie.py [--tokens 10000000]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from dss.index.hashing import chain_hashes
from dss.index.trie import RadixTrie
from dss.types import NamespaceId, PageHash

PAGE = 16
SESSION_TOKENS = 32 * 1024
TURNS = 4
VOCAB = 50_000
NS = NamespaceId(b"bench-namespace!")


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e6


def build(trie: RadixTrie, target_tokens: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Fill `trie` with sessions until it indexes `target_tokens`; return the sessions' tokens."""
    systems = [rng.integers(0, VOCAB, size=int(n) * PAGE, dtype=np.int32) for n in rng.integers(64, 256, 8)]
    system_hashes = [chain_hashes(NS, s, PAGE) for s in systems]
    sessions: list[np.ndarray] = []
    session_hashes: list[list[PageHash]] = []
    while len(trie) < target_tokens:
        if sessions and rng.random() < 0.3:
            # a fork: an edited message or a regenerated answer midway through an earlier session
            src = int(rng.integers(len(sessions)))
            shared_pages = int(rng.integers(1, SESSION_TOKENS // PAGE))
            prefix, prefix_hashes = sessions[src], session_hashes[src]
        else:
            k = int(rng.integers(len(systems)))
            prefix, prefix_hashes = systems[k], system_hashes[k]
            shared_pages = len(prefix) // PAGE
        shared = shared_pages * PAGE
        tokens = np.empty(SESSION_TOKENS, dtype=np.int32)
        tokens[:shared] = prefix[:shared]
        tokens[shared:] = rng.integers(0, VOCAB, size=SESSION_TOKENS - shared, dtype=np.int32)
        hashes = prefix_hashes[:shared_pages] + chain_hashes(
            NS, tokens, PAGE, parent=prefix_hashes[shared_pages - 1], start_page=shared_pages
        )
        for turn in range(1, TURNS + 1):
            end = SESSION_TOKENS * turn // TURNS
            trie.insert(tokens[:end], hashes[: end // PAGE])
        sessions.append(tokens)
        session_hashes.append(hashes)
    return sessions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (the suite runs this)")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.reps = 100_000, 5
    rng = np.random.default_rng(7)
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"cores: {affinity} usable of {os.cpu_count()}")

    trie = RadixTrie(PAGE)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    sessions = build(trie, args.tokens, rng)
    build_s = time.perf_counter() - t0
    session_bytes = sum(s.nbytes for s in sessions)  # the bench's own copies, not the index
    gc.collect()
    index_bytes = tracemalloc.get_traced_memory()[0] - base - session_bytes
    tracemalloc.stop()
    trie.check()
    n_tok = len(trie)
    print(
        f"built {n_tok:,} tokens, {trie.n_pages:,} pages, {trie.n_nodes:,} nodes "
        f"from {len(sessions)} sessions in {build_s:.1f} s (hashing included, under tracemalloc)"
    )
    bytes_per_token = index_bytes / n_tok
    print(
        f"index memory: {index_bytes / 2**20:.1f} MiB traced = {bytes_per_token:.2f} B/token "
        f"(nbytes() estimate {trie.nbytes() / n_tok:.2f} B/token)"
    )

    hit = sessions[len(sessions) // 2]
    m = trie.match(hit)
    if m.n_tokens != SESSION_TOKENS:
        raise SystemExit(f"full-hit probe matched {m.n_tokens} tokens")
    diverge = hit.copy()
    diverge[SESSION_TOKENS // 2 + 5 :] = rng.integers(0, VOCAB, size=SESSION_TOKENS // 2 - 5, dtype=np.int32)
    md = trie.match(diverge)
    if md.n_tokens != SESSION_TOKENS // 2:
        raise SystemExit(f"diverging probe matched {md.n_tokens} tokens")
    hit_list = hit.tolist()  # engines hand token ids over as Python lists

    full_ms = median_ms(lambda: trie.match(hit), args.reps)
    full_list_ms = median_ms(lambda: trie.match(hit_list), args.reps)
    half_ms = median_ms(lambda: trie.match(diverge), args.reps)
    depth, node = 0, m.node
    while node.parent is not None:
        depth, node = depth + 1, node.parent
    print(
        f"match 32k full hit:        {full_ms:.3f} ms median of {args.reps} "
        f"({m.n_pages} pages, {depth} nodes deep)"
    )
    print(f"match 32k full hit (list): {full_list_ms:.3f} ms")
    print(f"match 32k diverging at 16k: {half_ms:.3f} ms")

    # A session regenerated at every turn: its path crosses a branch point every 1k tokens.
    deep = rng.integers(0, VOCAB, size=SESSION_TOKENS, dtype=np.int32)
    deep_hashes = chain_hashes(NS, deep, PAGE)
    trie.insert(deep, deep_hashes)
    for cut in range(1024, SESSION_TOKENS, 1024):
        alt = np.concatenate((deep[:cut], rng.integers(0, VOCAB, size=16 * PAGE, dtype=np.int32)))
        trie.insert(
            alt,
            deep_hashes[: cut // PAGE]
            + chain_hashes(NS, alt, PAGE, deep_hashes[cut // PAGE - 1], cut // PAGE),
        )
    deep_ms = median_ms(lambda: trie.match(deep), args.reps)
    print(f"match 32k full hit, 32 nodes deep: {deep_ms:.3f} ms")

    index = {h: None for h in trie.iter_pages()}

    def hash_chain_lookup() -> int:
        n = 0
        for h in chain_hashes(NS, hit, PAGE):
            if h not in index:
                break
            n += 1
        return n

    chain_ms = median_ms(hash_chain_lookup, max(10, args.reps // 10))
    print(f"baseline hash-chain lookup (hash 2048 pages + dict probes): {chain_ms:.3f} ms")
    print(f"ratio baseline/trie match: {chain_ms / full_ms:.1f}x")

    n_new = 30
    system = sessions[0][: 128 * PAGE]
    new_seqs = []
    for _ in range(n_new):
        toks = np.concatenate((system, rng.integers(0, VOCAB, SESSION_TOKENS - len(system), dtype=np.int32)))
        new_seqs.append((toks, chain_hashes(NS, toks, PAGE)))
    t0 = time.perf_counter()
    for toks, hashes in new_seqs:
        trie.insert(toks, hashes)
    insert_s = time.perf_counter() - t0
    insert_tps = int(n_new * SESSION_TOKENS / insert_s)
    print(f"insert: {n_new} new 32k-token sequences in {insert_s * 1e3:.1f} ms = {insert_tps:,} tokens/s")
    trie.check()

    print(
        f"RESULT match_32k_ms={full_ms:.4f} insert_tokens_per_s={insert_tps} "
        f"index_bytes_per_token={bytes_per_token:.2f}"
    )


if __name__ == "__main__":
    main()
