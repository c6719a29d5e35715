"""`KVCache.wait_shared`: a turn's commit waits until the pages of its tenant's saves so far are
in the remote tier (every save planned before it reported, then every page published before it
written behind), bounded by `RemoteConfig.durable_wait_s`; nothing to wait for without a remote
tier. Real store, real Redis."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dss.config import RemoteConfig
from dss.store import Store
from tests.dss.pages.test_tier_remote import REDIS_URL, _redis_answers
from tests.store_helpers import SMALL_FP, open_store, pages_for, put_sequence

pytestmark = pytest.mark.skipif(not _redis_answers(REDIS_URL), reason=f"no Redis answers at {REDIS_URL}")

BS = SMALL_FP.block_size


@pytest.fixture
def shared_store(tmp_path: Path) -> Iterator[tuple[Store, str]]:
    prefix = f"test-wait-{uuid.uuid4().hex[:8]}:"
    remote = RemoteConfig(url=REDIS_URL, key_prefix=prefix, durable_wait_s=0.5)
    with open_store(tmp_path, remote=remote) as store:
        yield store, prefix
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(f"{prefix}*"))
    if keys:
        client.delete(*keys)


def test_nothing_to_wait_for_without_a_remote_tier(tmp_path: Path) -> None:
    with open_store(tmp_path) as store:
        assert store.kv.wait_shared(store.identity.tenant_for("alice")) is None


def test_a_wait_ends_when_the_tenants_saves_reached_redis(shared_store: tuple[Store, str]) -> None:
    store, _ = shared_store
    fid = store.fingerprints.register(SMALL_FP)
    alice, bob = store.identity.tenant_for("alice"), store.identity.tenant_for("bob")
    tokens = np.arange(1, 6 * BS + 1, dtype=np.int32)
    # A save planned and not yet reported (the engine is still copying): the wait holds...
    plan = store.kv.plan_save(fid, alice, tokens, 6)
    began = time.monotonic()
    assert store.kv.wait_shared(alice) is False  # ... until `durable_wait_s` (0.5 s) runs out
    assert time.monotonic() - began >= 0.45
    assert store.kv.wait_shared(bob) is True  # another tenant's save is not this one's wait

    # Reported while a turn waits: the wait ends once its pages were written behind.
    pages = pages_for(SMALL_FP, tokens)
    for ps in plan.pages:
        assert ps.slot is not None
        store.pages.host.slot_array(ps.slot)[:] = np.frombuffer(pages[ps.page_index], dtype=np.uint8)
    waited: list[bool | None] = []
    waiter = threading.Thread(target=lambda: waited.append(store.kv.wait_shared(alice)))
    waiter.start()
    time.sleep(0.05)
    assert store.kv.saves.commit_save(plan.save_id, [ps.page_index for ps in plan.pages]) == 6
    waiter.join(5)
    assert waited == [True]
    assert store.stats()["remote_writes"] == 6  # every page is in Redis when the wait returns


def test_pages_published_before_the_wait_are_written_before_it_returns(
    shared_store: tuple[Store, str],
) -> None:
    store, _ = shared_store
    fid = store.fingerprints.register(SMALL_FP)
    alice = store.identity.tenant_for("alice")
    for k in range(3):
        tokens = np.arange(100 * k + 1, 100 * k + 1 + 4 * BS, dtype=np.int32)
        assert put_sequence(store, fid, alice, tokens, pages_for(SMALL_FP, tokens)) == 4
    assert store.kv.wait_shared(alice) is True
    assert store.stats()["remote_writes"] == 12
