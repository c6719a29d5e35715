"""Pages outlive the engine that wrote them, never cross model fingerprints, and a failed load is
recomputed, never served wrong.

One store, three engines started one after another: A (block size 128) writes a session; C
(block size 64, another fingerprint) must not load it; B (block size 128, a fresh engine) loads
it, then survives a lost arena file, a whole-store restart (pages only on disk: async loads) and
a corrupted page file. Each engine runs in this process (`deterministic_batches`: no engine
processes to spawn, a start of ~3-6 s instead of ~25-30 s on 2 cores); what a restart loses is
the engine, its KV cache and its connector, which closing it takes down all the same. Engines in
processes of their own (`dss serve`'s) restart in `tests/api/test_restart.py` and the soak.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dss.index.hashing import chain_hashes
from dss.namespace import make_namespace
from dss.rpc import StoreServer
from dss.store import Store
from dss.types import FingerprintId
from tests.engine_helpers import Engine, Result, open_store, words

pytestmark = [pytest.mark.engine, pytest.mark.slow]

BS = 128


class ServedStore:
    """A store whose RPC address and authkey survive a close/reopen of the store, as a running
    engine's connector config needs across a whole-store restart."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.address = str(data_dir.parent / f"{data_dir.name}-rpc.sock")
        self.authkey = os.urandom(32)
        self.store: Store = open_store(data_dir)
        self.server = StoreServer(self.store.engine_calls(), self.address, self.authkey)

    def restart(self) -> None:
        self.close()
        self.store = open_store(self.data_dir)
        self.server = StoreServer(self.store.engine_calls(), self.address, self.authkey)

    def close(self) -> None:
        self.store.flush()
        self.server.close()
        self.store.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServedStore]:
    s = ServedStore(tmp_path / "store")
    try:
        yield s
    finally:
        s.close()


def one(engine: Engine, prompt: list[int], sess: dict[str, object] | None, reset: bool = True) -> Result:
    if reset:
        engine.reset_prefix_cache()
    (r,) = engine.generate([prompt], [sess], 24)
    return r


def test_restart_fingerprints_and_failed_loads(served: ServedStore) -> None:
    rng = np.random.default_rng(21)
    tenant = served.store.identity.tenant_for("restart-user")
    sid = "restart-session"

    # --- engine A writes turn 1 of a session; its own prefix cache gives the reference turn 2.
    a = Engine(served.address, served.authkey, deterministic_batches=True)
    try:
        p1 = a.chat_ids([{"role": "user", "content": f"Keep these words in mind: {words(rng, 700)}"}])
        assert len(p1) > 6 * BS
        t1 = one(a, p1, a.session(tenant, sid))
        computed_1 = len(p1) + len(t1.output_ids) - 1  # all but the last sampled token
        # Its whole pages and its tail page.
        assert t1.params is not None and t1.params["stored_pages"] == -(-computed_1 // BS)
        fid = FingerprintId(t1.params["fingerprint"])
        p2 = a.continue_ids(p1, t1.output_ids, f"Which of them relate to {words(rng, 12)}?")
        a.settle()
        warm_a = one(a, p2, None, reset=False)  # vLLM's cache holds exactly the saved bytes
        saved_pages = computed_1 // BS  # whole pages; vLLM's own cache holds those only
        assert warm_a.num_cached_tokens == min(saved_pages, (len(p2) - 1) // BS) * BS
        want_loaded = min(computed_1, len(p2) - 1)  # DSS: the tail page too
    finally:
        a.close()

    # --- engine C: another block size is another fingerprint; nothing of A's may load.
    c = Engine(served.address, served.authkey, deterministic_batches=True, block_size=64)
    try:
        r = one(c, p2, c.session(tenant, sid))
        assert r.loaded_tokens == 0 and r.num_cached_tokens == 0
        assert r.params is not None and r.params["fingerprint"] != fid
        cold_c = one(c, p2, None)
        assert r.output_ids == cold_c.output_ids
    finally:
        c.close()
    assert len(served.store.fingerprints) == 2

    # --- engine B: a new engine on the same store loads A's pages and answers like A.
    b = Engine(served.address, served.authkey, deterministic_batches=True)
    try:
        cold_b = one(b, p2, None)
        r = one(b, p2, b.session(tenant, sid))
        assert r.loaded_tokens == want_loaded
        if r.num_cached_tokens == warm_a.num_cached_tokens:  # the same KV bytes: bit for bit
            assert r.output_ids == warm_a.output_ids
        elif r.output_ids != warm_a.output_ids:  # a tail page beyond A's cache (numerics, as cold)
            print(f"\nrestart: with the tail {r.text!r} != A's prefix cache {warm_a.text!r}")
        # That turn saved the rest of p2's pages; B's own prefix cache now holds all of them.
        warm_b = one(b, p2, None, reset=False)
        assert warm_b.num_cached_tokens == ((len(p2) - 1) // BS) * BS
        if r.output_ids != cold_b.output_ids:
            print(f"\nrestart: cached {r.text!r} != cold {cold_b.text!r} (numerics of KV reuse)")

        # The arena file vanishes under the worker: the sync load fails, vLLM recomputes.
        q = [*p1, *t1.output_ids][: saved_pages * BS + 5]
        cold_q = one(b, q, None)
        page_nbytes = served.store.fingerprints.get(fid).page_nbytes
        arena = Path(served.store.host.directory) / f"arena-{page_nbytes}.shm"
        hidden = arena.with_suffix(".hidden")
        os.rename(arena, hidden)
        try:
            r = one(b, q, b.session(tenant, sid))
        finally:
            os.rename(hidden, arena)
        assert r.params is not None and r.params["loaded_tokens"] == 0
        assert r.output_ids == cold_q.output_ids

        # Whole-store restart: the arena is gone, pages are on disk only -> async loads of the
        # very bytes a load from the host arena used just before (tail page included).
        from_host = one(b, p2, b.session(tenant, sid))
        assert from_host.loaded_tokens == len(p2) - 1
        b.settle()
        served.restart()
        assert served.store.stats()["pages"]["host"] == 0
        r = one(b, p2, b.session(tenant, sid))
        assert r.loaded_tokens == len(p2) - 1
        assert r.output_ids == from_host.output_ids
        assert served.store.stats()["promotions"]["host"] >= -(-(len(p2) - 1) // BS)

        # A corrupted page file: the promotion fails its check, vLLM recomputes from there.
        served.restart()
        first_page = chain_hashes(make_namespace(fid, tenant).id, p2[:BS], BS)[0]
        path = served.store.disk.path_of(first_page)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        r = one(b, p2, b.session(tenant, sid))
        assert r.params is not None and r.params["loaded_tokens"] == 0
        assert r.output_ids == cold_b.output_ids
        assert served.store.stats()["corrupt_pages"] >= 1
        served.store.check()
    finally:
        b.close()
