"""A real vLLM engine publishes the store's host and disk pages as KV events (one engine start).

vLLM's KV events are on (`EngineSettings.kv_events_endpoint`, a local ipc:// socket the
publisher binds); a subscriber decodes every batch with vLLM's `KVEventBatch` and rebuilds the
server's DSS holdings (the `CPU` and `STORAGE` blocks, stored minus removed): after two sessions'
turns, after their pages reach the disk, after a host eviction (demotion) and after a user's
erasure, the view equals the store's whole pages for the engine's fingerprint, exactly. Events are
published at engine steps, so each check runs a plain request first.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from dss.store import Store
from dss.types import Tier
from engine_patch.connector.kv_events import block_hash
from tests.engine_helpers import Engine, make_conversations, open_store
from tests.kv_router import DSS_MEDIA, Holdings, LlmdIndex, Subscriber

pytestmark = pytest.mark.engine

POD = "127.0.0.1:8000"


def expected(store: Store, fid: str, block_size: int) -> set[tuple[int | bytes, str]]:
    medium = {Tier.HOST: "CPU", Tier.DISK: "STORAGE"}
    return {
        (block_hash(e.meta.hash), medium[t])
        for e in store.pages.table.snapshot()
        for t in e.tiers
        if t in medium and e.meta.fingerprint == fid and e.meta.n_tokens == block_size
    }


def test_the_engine_publishes_the_stores_pages_and_a_router_rebuilds_them(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    address, authkey = store.serve_rpc()
    endpoint = f"ipc://{tmp_path}/kv-events"
    engine = Engine(
        address,
        authkey,
        deterministic_batches=True,
        kv_events_endpoint=endpoint,
        kv_events_topic=f"kv@{POD}@smollm2",
        kv_events_poll_s=0.0,
    )
    sub = Subscriber(endpoint, b"kv@")
    holdings = Holdings()
    try:
        bs = engine.llm.llm_engine.vllm_config.cache_config.block_size
        index = LlmdIndex(bs, "smollm2", media=DSS_MEDIA)  # DSS's pages, not vLLM's own blocks
        rng = np.random.default_rng(3)
        time.sleep(1.0)  # the subscription reaches the publisher

        def plain_step() -> None:
            """A plain request: engine steps, at which the connector's events are published."""
            engine.generate([[int(t) for t in rng.integers(1000, 2000, 8)]], [None], 2)

        def sync() -> set[tuple[int | bytes, str]]:
            plain_step()
            for topic, batch in sub.receive(1.5):
                holdings.apply(topic, batch)
                index.apply(topic.split("@")[1], batch)
            fids = {e.meta.fingerprint for e in store.pages.table.snapshot()}
            assert len(fids) <= 1
            want = expected(store, fids.pop(), bs) if fids else set()
            assert holdings.held[f"kv@{POD}@smollm2"] == want
            return want

        alice, bob = store.identity.tenant_for("alice"), store.identity.tenant_for("bob")
        convs = make_conversations(2, seed=11)
        prompts = [engine.chat_ids(c.first) for c in convs]
        prompts = [(p * (1 + 300 // len(p)))[:300] for p in prompts]  # two whole blocks and a tail
        engine.generate(prompts, [engine.session(alice, "a1"), engine.session(bob, "b1")], 16)
        engine.settle()
        held = sync()
        assert {m for _, m in held} >= {"CPU"} and len(held) >= 4, held
        assert holdings.cleared, "the first read announced a clean view"
        assert index.pick([*prompts[0], 1, 2]) == POD

        assert store.flush(60)  # the write-back reaches the disk: STORAGE blocks too
        held = sync()
        assert "STORAGE" in {m for _, m in held}

        # a host eviction: the pages leave the host (BlockRemoved CPU), stay on disk
        removed_before = holdings.removed
        on_host = [e.meta.hash for e in store.pages.table.snapshot() if Tier.HOST in e.tiers]
        assert store.pages.demoter.demote_to_disk(on_host, []) > 0
        held = sync()
        assert holdings.removed > removed_before and "CPU" not in {m for _, m in held}

        # alice's erasure: her pages are gone from the router's view. llm-d keys blocks by their
        # tokens alone (a cache salt is not part of its key), so what still matches her prompt
        # is the chat template's leading blocks bob's pages share (disk weight 0.4 each).
        removed_before = holdings.removed
        store.eraser.erase_user("alice")
        sync()
        assert holdings.removed > removed_before
        a, b = np.asarray(prompts[0][:256]), np.asarray(prompts[1][:256])
        shared = int(np.argmax(a != b)) // bs if (a != b).any() else 256 // bs
        assert index.scores(prompts[0]) == ({POD: pytest.approx(0.4 * shared)} if shared else {})
        assert index.scores(prompts[1]) == {POD: pytest.approx(0.4 * 2)}
    finally:
        sub.close()
        engine.close()
        store.close()
