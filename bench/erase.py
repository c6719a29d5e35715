"""Time to erase a user with 100 sessions x 10 versions (pages on host and disk), and the
remnants that verification finds afterwards (goal 0)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
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
    num_layers=2,
    num_kv_heads=2,
    head_size=16,
    block_size=16,
)
SESSIONS, VERSIONS, TOKENS_PER_TURN = 100, 10, 32


def main() -> None:
    smoke = "--smoke" in sys.argv[1:]  # tiny sizes, seconds (the suite runs this)
    sessions = 5 if smoke else SESSIONS
    print(f"cores={os.cpu_count()}")
    with tempfile.TemporaryDirectory() as d:
        store = Store.open(StoreConfig(data_dir=Path(d), fsync=False, host_capacity_bytes=1 << 28))
        fid = store.fingerprints.register(FP)
        user = "erase-bench-user"
        tenant = store.identity.tenant_for(user)
        rng = np.random.default_rng(0)
        page = rng.integers(0, 255, FP.page_nbytes, dtype=np.uint8).tobytes()
        t0 = time.perf_counter()
        for _ in range(sessions):
            sid = store.versions.create_session(user).id
            tokens = np.array([], dtype=np.int32)
            for v in range(VERSIONS):
                tokens = np.concatenate([tokens, rng.integers(0, 50_000, TOKENS_PER_TURN, dtype=np.int32)])
                store.versions.commit(
                    user, sid, tokens=tokens, messages=[{"role": "user", "content": str(v)}]
                )
            put_sequence(store, fid, tenant, tokens, [page] * (len(tokens) // FP.block_size))
        store.flush()
        fill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        receipt = store.eraser.erase_user(user)
        erase_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        verification = store.eraser.verify(receipt.id)
        verify_s = time.perf_counter() - t0
        store.close()
    print(f"fill_s={fill_s:.2f} counts={receipt.counts} verify_s={verify_s:.3f}")
    print(f"RESULT erase_s={erase_s:.3f} remnants={verification.remnants}")


if __name__ == "__main__":
    main()
