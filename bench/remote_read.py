"""The remote tier's read rate beside Redis's own ceiling for the same values, on this machine.

Pages are real KV bytes (/work/shared/data/kv_sample.bin: one page is one 128-token block of the
default model across its 30 layers, 2,949,120 B), encrypted and checksummed as DSS stores them,
encoded each way compared: no compression, byte-plane zstd at a few levels. For each encoding:

- `redis_ceiling_mbps`: the same values read by a plain redis-py client, `GET`s pipelined, the
  best of a few batch sizes and numbers of batches in flight (threads), no decoding: what Redis
  and the socket give a Python client here (with hiredis when installed, as DSS).
  `redis-benchmark -d <size> -t set,get` is run too when installed (C client, no Python at all).
- DSS (`RemoteTier.read_many`, each page decoded straight into a page-sized slot on the reader
  thread, as `Promoter.fetch_remote` does with host slots): MB/s of values read (at rest), MB/s of
  KV delivered (uncompressed), and the seconds apart: network (round trips), decode (checksums,
  AES-GCM, zstd; summed over the reader threads), promote (what is left to the caller).
- `--old`: also the read path before issue 30 (an EXISTS round trip, then one GETEX+ZADD round
  trip per page on two loader threads, decoded one by one), for a before/after on one machine.

The encoding with the highest KV rate is the one to configure (`RemoteConfig.codec`, default set
from this benchmark's numbers; see docs/operations.md). Each timing is the best of `--trials`.

    .venv/bin/python bench/remote_read.py [--pages 48] [--trials 3] [--old]
    .venv/bin/python bench/remote_read.py --smoke     # a few pages, seconds

Needs Redis (`DSS_TEST_REDIS_URL`, default redis://127.0.0.1:6379/0; keys under a fresh prefix,
removed at the end). The last line is `RESULT remote_load_mbps= redis_ceiling_mbps=
read_vs_ceiling= network_s= decode_s= promote_s= kv_mbps= codec=` for the chosen encoding.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dss.config import RemoteConfig
from dss.index.hashing import ROOT_PARENT, page_hash
from dss.pages.codec import make_codec
from dss.pages.meta import PageMeta
from dss.pages.pagefile import encode_page
from dss.pages.tiers.remote import RemoteTier
from dss.types import FingerprintId, NamespaceId, PageHash, TenantId

REDIS_URL = os.environ.get("DSS_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
SAMPLE = (
    next(
        (p for p in (Path(__file__).resolve().parents[2] / "shared", Path("/work/shared")) if p.exists()),
        Path("/work/shared"),
    )
    / "data"
    / "kv_sample.bin"
)
ENCODINGS = ("none", "zstd-byteplane:-1", "zstd-byteplane:1", "zstd-byteplane:3")
KEY = os.urandom(32)
TENANT = TenantId("bench")


def sample_pages(n: int, smoke: bool) -> list[np.ndarray]:
    """`n` pages of real KV bytes (uint8): the sample's 4 blocks, each later one perturbed in its
    low bits so that no two pages are the same bytes."""
    if SAMPLE.exists():
        sample = np.fromfile(SAMPLE, dtype=np.uint16).reshape(30, 4, -1)
        blocks = [np.ascontiguousarray(sample[:, b]).reshape(-1) for b in range(4)]
    else:  # no sample here: bf16-like noise (compresses about as byte-plane zstd compresses KV)
        rng = np.random.default_rng(0)
        blocks = [
            (rng.standard_normal(30 * 49152).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        ]
    if smoke:
        blocks = [b[: 30 * 4096] for b in blocks]
    out = []
    for i in range(n):
        b = blocks[i % len(blocks)].copy()
        b[:: 97 + i] ^= np.uint16(i & 0x3)
        out.append(b.view(np.uint8))
    return out


def metas(n: int, nbytes: int) -> list[PageMeta]:
    ns = NamespaceId(b"b" * 16)
    out = []
    parent = ROOT_PARENT
    for i in range(n):
        tokens = np.arange(i * 128, (i + 1) * 128, dtype=np.int32)
        h = page_hash(ns, parent, tokens)
        out.append(
            PageMeta(
                hash=h,
                namespace=ns,
                tenant=TENANT,
                fingerprint=FingerprintId("bench"),
                parent=parent,
                index=i,
                nbytes=nbytes,
                tokens=tokens,
            )
        )
        parent = h
    return out


@dataclass
class Run:
    codec: str
    at_rest_bytes: int
    kv_bytes: int
    seconds: float
    network_s: float
    decode_s: float
    promote_s: float

    @property
    def load_mbps(self) -> float:
        return self.at_rest_bytes / 1e6 / self.seconds

    @property
    def kv_mbps(self) -> float:
        return self.kv_bytes / 1e6 / self.seconds


class Slots:
    """`ReadInto` over preallocated page-sized arrays, as the host arena's slots are to a store."""

    def __init__(self, pages: list[PageHash], slots: list[np.ndarray]) -> None:
        self._of = {p: (i, s) for i, (p, s) in enumerate(zip(pages, slots, strict=True))}

    def take(self, page: PageHash, nbytes: int) -> tuple[int, np.ndarray] | None:
        return self._of[page]

    def give_back(self, ref: object) -> None:
        pass


def dss_read(tier: RemoteTier, pages: list[PageHash], slots: list[np.ndarray], codec: str) -> Run:
    """Each page decoded straight into its slot on a reader thread (as `Promoter.fetch_remote`
    does with host slots); `promote` is what is left to the caller: the page table's update,
    timed here as the loop's own work (nothing to copy)."""
    before = tier.read_times()
    t0 = time.perf_counter()
    promote = 0.0
    at_rest = kv = 0
    into = Slots(pages, slots)
    for i, got in enumerate(tier.read_many(pages, KEY, page_nbytes=slots[0].size, into=into)):
        assert got is not None, f"page {i} missing"
        p0 = time.perf_counter()
        if got.slot is None:
            slots[i][:] = got.raw
        promote += time.perf_counter() - p0
        at_rest += got.header.file_len
        kv += got.raw.size
    dt = time.perf_counter() - t0
    after = tier.read_times()
    return Run(
        codec, at_rest, kv, dt, after.network_s - before.network_s, after.decode_s - before.decode_s, promote
    )


def old_read(tier: RemoteTier, pages: list[PageHash], slots: list[np.ndarray], codec: str) -> Run:
    """The path before issue 30: EXISTS of every page, then a GETEX+ZADD round trip per page on
    two loader threads, each page decoded into its slot as it comes."""
    t0 = time.perf_counter()
    assert all(tier.exists(pages))
    sizes = [0] * len(pages)

    def one(i: int) -> None:
        header, _tokens, _raw = tier.read(pages[i], KEY, out=slots[i])
        sizes[i] = header.file_len

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(one, range(len(pages))))
    dt = time.perf_counter() - t0
    return Run(f"{codec} (old path)", sum(sizes), sum(s.size for s in slots), dt, 0.0, 0.0, 0.0)


CEILING_SHAPES = ((1, 1), (1, 2), (2, 2), (4, 4), (16, 4))  # (values per round trip, in flight)


def ceiling(keys: list[str]) -> float:
    """MB/s of plain pipelined GETs of `keys` (no decoding): the best of a few batch sizes and
    numbers of batches in flight."""
    return max(plain_read(keys, batch, streams) for batch, streams in CEILING_SHAPES)


def plain_read(keys: list[str], batch: int, streams: int) -> float:
    """MB/s of plain pipelined GETs of `keys` (no decoding), `streams` batches in flight."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=30)
    batches = [keys[lo : lo + batch] for lo in range(0, len(keys), batch)]
    total = 0
    lock = threading.Lock()

    def one(ks: list[str]) -> None:
        nonlocal total
        pipe = client.pipeline(transaction=False)
        for k in ks:
            pipe.get(k)
        n = sum(len(v or b"") for v in pipe.execute())
        with lock:
            total += n

    with ThreadPoolExecutor(streams) as pool:
        t0 = time.perf_counter()
        list(pool.map(one, batches))
        dt = time.perf_counter() - t0
    client.close()
    return total / 1e6 / dt


def redis_benchmark(size: int, n: int, pipeline: int) -> float | None:
    """MB/s of GETs of `size`-byte values by `redis-benchmark` (C, 4 connections; its SET test
    writes the value its GET test reads), if installed."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    import redis

    c = redis.Redis.from_url(REDIS_URL)
    kw = c.connection_pool.connection_kwargs
    host, port, db = kw.get("host", "127.0.0.1"), kw.get("port", 6379), kw.get("db", 0)
    key = f"bench-rb-{uuid.uuid4().hex[:8]}"
    cmd = [binary, "-h", str(host), "-p", str(port), "--dbnum", str(db), "-c", "4", "-P", str(pipeline)]
    cmd += ["-n", str(n), "-d", str(size), "-q", "-t", "set,get"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    except (subprocess.TimeoutExpired, OSError):
        return None
    finally:
        c.delete(key, "key:__rand_int__")
    m = re.search(r"GET: ([0-9.]+) requests per second", out.replace("\r", "\n"))
    return float(m.group(1)) * size / 1e6 if m else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=48)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--batch", type=int, default=RemoteConfig().read_batch)
    ap.add_argument("--streams", type=int, default=RemoteConfig().read_streams)
    ap.add_argument("--codecs", default=",".join(ENCODINGS), help="the encodings compared")
    ap.add_argument("--old", action="store_true", help="also time the read path before issue 30")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    n, trials = (6, 1) if args.smoke else (args.pages, args.trials)
    encodings = ("none", "zstd-byteplane:1") if args.smoke else tuple(args.codecs.split(","))
    raw_pages = sample_pages(n, args.smoke)
    nbytes = raw_pages[0].size
    ms = metas(n, nbytes)
    prefix = f"bench-rr-{uuid.uuid4().hex[:8]}:"
    config = RemoteConfig(
        url=REDIS_URL, key_prefix=prefix, timeout_s=30.0, read_batch=args.batch, read_streams=args.streams
    )
    per = max(1, min(args.batch, config.read_batch_bytes // nbytes))
    print(f"{n} pages of {nbytes:,} B, {per} per round trip, {args.streams} in flight, best of {trials}")
    runs: list[Run] = []
    ceilings: dict[str, float] = {}
    slots = [np.empty(nbytes, dtype=np.uint8) for _ in range(n)]
    import redis

    admin = redis.Redis.from_url(REDIS_URL)
    try:
        for name in encodings:
            codec = make_codec(name)
            tier = RemoteTier(config, codec)
            blobs = [encode_page(m, raw.data, codec, KEY) for m, raw in zip(ms, raw_pages, strict=True)]
            for m, blob in zip(ms, blobs, strict=True):
                tier.delete([m.hash])
                tier.put(m.hash, m.tenant, blob)
            pages = [m.hash for m in ms]
            keys = [tier.page_key(h) for h in pages]
            best = min((dss_read(tier, pages, slots, name) for _ in range(trials)), key=lambda r: r.seconds)
            for s, raw in zip(slots, raw_pages, strict=True):
                assert np.array_equal(s, raw), "a page read back differs"
            ceilings[name] = max(ceiling(keys) for _ in range(trials))
            size = sum(len(b) for b in blobs) // len(blobs)
            print(
                f"{name:20s} value {size:>9,} B  DSS {best.load_mbps:7.0f} MB/s at rest, "
                f"{best.kv_mbps:7.0f} MB/s of KV in {best.seconds:.3f} s "
                f"(network {best.network_s:.3f} s, decode {best.decode_s:.3f} s, "
                f"promote {best.promote_s:.3f} s)"
                f"  | plain pipelined client {ceilings[name]:7.0f} MB/s"
            )
            runs.append(best)
            if args.old:
                old = min(
                    (old_read(tier, pages, slots, name) for _ in range(trials)), key=lambda r: r.seconds
                )
                print(f"{'':20s} old path: {old.load_mbps:7.0f} MB/s at rest, {old.kv_mbps:7.0f} MB/s of KV")
            tier.close()
        size = nbytes if args.smoke else RemoteConfig().read_batch
        rb = redis_benchmark(nbytes, 20 if args.smoke else 400, size if size < 64 else 16)
        if rb is not None:
            print(f"redis-benchmark GET -d {nbytes}: {rb:.0f} MB/s (C client, 4 connections)")
    finally:
        keys = list(admin.scan_iter(f"{prefix}*"))
        if keys:
            admin.delete(*keys)
    chosen = max(runs, key=lambda r: r.kv_mbps)
    ceil = ceilings[chosen.codec]
    print(f"fastest KV delivery: {chosen.codec}")
    print(
        f"RESULT remote_load_mbps={chosen.load_mbps:.0f} redis_ceiling_mbps={ceil:.0f} "
        f"read_vs_ceiling={chosen.load_mbps / ceil:.2f} network_s={chosen.network_s:.3f} "
        f"decode_s={chosen.decode_s:.3f} promote_s={chosen.promote_s:.3f} kv_mbps={chosen.kv_mbps:.0f} "
        f"codec={chosen.codec}"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
