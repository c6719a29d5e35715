"""Stored KV bytes for N branches off a shared base vs base + N x suffix (goal <= 1.05).

Branches of a session share every common page: the content address of a page covers its prefix,
so the base is stored once however many branches fork from it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dss.config import StoreConfig
from dss.namespace import ModelFingerprint
from dss.store import Store
from tests.store_helpers import put_sequence

FP = ModelFingerprint(
    model_id="bench",
    revision="1",
    dtype="bfloat16",
    num_layers=4,
    num_kv_heads=2,
    head_size=32,
    block_size=16,
)
BASE_TOKENS = 2048
SUFFIX_TOKENS = 256
N_BRANCHES = 16


def main() -> None:
    smoke = "--smoke" in sys.argv[1:]  # tiny sizes, seconds (the suite runs this)
    n_branches = 2 if smoke else N_BRANCHES
    print(f"cores={os.cpu_count()} page_bytes={FP.page_nbytes}")
    with tempfile.TemporaryDirectory() as d:
        store = Store.open(
            StoreConfig(data_dir=Path(d), fsync=False, host_capacity_bytes=1 << 30, write_through=False)
        )
        fid = store.fingerprints.register(FP)
        tenant = store.identity.tenant_for("bench-user")
        sid = store.versions.create_session("bench-user").id
        rng = np.random.default_rng(0)
        base = rng.integers(0, 50_000, BASE_TOKENS, dtype=np.int32)
        page = bytes(FP.page_nbytes)
        base_v = store.versions.commit(
            "bench-user", sid, tokens=base, messages=[{"role": "user", "content": "b"}]
        )
        put_sequence(store, fid, tenant, base, [page] * (BASE_TOKENS // FP.block_size))
        for i in range(n_branches):
            name = f"b{i}"
            store.versions.branch("bench-user", sid, base_v.number, name)
            seq = np.concatenate([base, rng.integers(0, 50_000, SUFFIX_TOKENS, dtype=np.int32)])
            store.versions.commit(
                "bench-user", sid, tokens=seq, messages=[{"role": "user", "content": name}], branch=name
            )
            put_sequence(store, fid, tenant, seq, [page] * (len(seq) // FP.block_size))
        stored = store.stats()["bytes"]["host"]
        ideal = (BASE_TOKENS + n_branches * SUFFIX_TOKENS) // FP.block_size * FP.page_nbytes
        naive = n_branches * (BASE_TOKENS + SUFFIX_TOKENS) // FP.block_size * FP.page_nbytes
        store.check()
        store.close()
    print(f"branches={n_branches} stored_bytes={stored} base_plus_suffixes={ideal} without_sharing={naive}")
    print(f"RESULT branch_overhead={stored / ideal:.4f}")


if __name__ == "__main__":
    main()
