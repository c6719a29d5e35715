"""Builders shared by the store tests: a small fingerprint, page bytes, an open store."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from dss.config import StoreConfig
from dss.namespace import ModelFingerprint
from dss.store import Store

SMALL_FP = ModelFingerprint(
    model_id="tiny-test",
    revision="r1",
    dtype="bfloat16",
    num_layers=2,
    num_kv_heads=2,
    head_size=8,
    block_size=4,
)


def page_bytes(fp: ModelFingerprint, seed: int) -> bytes:
    """Deterministic KV-like page content (bf16 bit patterns of small normal values)."""
    rng = np.random.default_rng(seed)
    vals = rng.standard_normal(fp.page_nbytes // 2).astype(np.float32)
    return (vals.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def pages_for(fp: ModelFingerprint, tokens: np.ndarray, salt: int = 0) -> list[bytes]:
    """Page i's bytes depend on the tokens up to and including page i, like real KV."""
    bs = fp.block_size
    out = []
    for i in range(len(tokens) // bs):
        seed = zlib.crc32(np.ascontiguousarray(tokens[: (i + 1) * bs]).tobytes()) + salt
        out.append(page_bytes(fp, seed))
    return out


def open_store(data_dir: Path, **overrides: object) -> Store:
    options: dict[str, object] = {"fsync": False, "host_capacity_bytes": 1 << 24, **overrides}
    cfg = StoreConfig(data_dir=data_dir, **options)  # type: ignore[arg-type]
    return Store.open(cfg)
