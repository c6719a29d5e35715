"""The store's pages as vLLM KV events (`engine_patch.connector.kv_events`), through vLLM's own ZMQ
publisher, into a router's index: two servers (a page table and a publisher each), one subscriber.

- Every event decodes with vLLM's `KVEventBatch`; the (block hash, medium) pairs rebuilt from them
  are exactly each server's host (`CPU`) and disk (`STORAGE`) pages, after stores, a demotion, an
  eviction, an erasure and a store restart (`AllBlocksCleared`, then the holdings again).
- llm-d's index (its key computation reproduced in `tests.kv_router.LlmdIndex`) and NVIDIA
  Dynamo's own `RadixTree` (`tests.kv_router.DynamoIndex`; `ai-dynamo-runtime` from PyPI, installed
  for the tests on first use) pick the server that holds a session's KV for that session's
  next turn, and neither once the pages are erased.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from dss.index.hashing import ROOT_PARENT, chain_hashes, page_hash
from dss.pages.eviction import PageStats
from dss.pages.meta import PageMeta
from dss.pages.table import PageEntry, PageTable
from dss.types import FingerprintId, NamespaceId, PageHash, TenantId, Tier
from dss.wire import PageEventBatch
from engine_patch.connector.kv_events import StoreEvents, block_hash
from tests.kv_router import DynamoIndex, Holdings, LlmdIndex, Subscriber

BS = 4
FID = FingerprintId("fp-events")
MODEL = "SmolLM2-135M-Instruct"


class TableClient:
    """The store's side of `take_events`, without the socket (the RPC is tested in tests/dss/rpc)."""

    def __init__(self, table: PageTable) -> None:
        self.table = table

    def take_events(
        self, fid: FingerprintId, epoch: str, after: int, limit: int = 4096, *, timeout_s: float | None = None
    ) -> PageEventBatch:
        return self.table.take_events(fid, epoch, after, limit)

    def close(self) -> None:
        pass


@dataclass
class Server:
    pod: str
    table: PageTable
    events: StoreEvents
    publisher: ZmqEventPublisher

    @property
    def topic(self) -> str:
        return f"kv@{self.pod}@{MODEL}"

    def step(self) -> None:
        """What vLLM's scheduler does at the end of a step with the connector's events."""
        events = self.events.take()
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))

    def store(self, tenant: str, tokens: list[int], tiers: set[Tier]) -> list[PageHash]:
        """A session's pages (whole pages and its tail page) as the store commits them."""
        ns = NamespaceId(tenant.encode().ljust(16, b"\0"))
        hashes = chain_hashes(ns, tokens, BS)
        arr = np.asarray(tokens, dtype=np.int32)
        parents = [ROOT_PARENT, *hashes]
        tail = arr[len(hashes) * BS :]
        if len(tail):
            hashes = [*hashes, page_hash(ns, parents[len(hashes)], tail)]
        for i, h in enumerate(hashes):
            meta = PageMeta(h, ns, TenantId(tenant), FID, parents[i], i, 64, arr[i * BS : (i + 1) * BS])
            assert self.table.insert(PageEntry(meta, PageStats(0.0, 0, 0.0, i, 64), set(tiers)))
        return hashes


def expected(table: PageTable) -> set[tuple[int | bytes, str]]:
    medium = {Tier.HOST: "CPU", Tier.DISK: "STORAGE"}
    return {
        (block_hash(e.meta.hash), medium[t])
        for e in table.snapshot()
        for t in e.tiers
        if t in medium and e.meta.n_tokens == BS
    }


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[list[Server], Subscriber]]:
    servers = []
    for i in range(2):
        table = PageTable()
        pod = f"10.0.0.{i + 1}:8000"
        # each publisher binds a local socket (vLLM binds ipc:// and wildcard endpoints)
        endpoint = f"ipc://{tmp_path}/kv-events-{i}"
        publisher = ZmqEventPublisher(0, endpoint=endpoint, topic=f"kv@{pod}@{MODEL}")
        events = StoreEvents(TableClient(table), lambda: FID, BS, poll_s=0.0)  # type: ignore[arg-type]
        servers.append(Server(pod, table, events, publisher))
    sub = Subscriber(f"ipc://{tmp_path}/kv-events-0", b"kv@", bind=False)
    sub.sock.connect(f"ipc://{tmp_path}/kv-events-1")
    time.sleep(1.0)  # ZMQ's slow joiner: the subscription reaches the publishers
    try:
        yield servers, sub
    finally:
        sub.close()
        for s in servers:
            s.publisher.shutdown()


def deliver(
    servers: list[Server], sub: Subscriber, holdings: Holdings, index: LlmdIndex, dynamo: DynamoIndex
) -> None:
    for s in servers:
        s.step()
    for topic, batch in sub.receive(1.0):
        holdings.apply(topic, batch)
        index.apply(topic.split("@")[1], batch)
        dynamo.apply(topic.split("@")[1], batch)
    for s in servers:
        assert holdings.held[s.topic] == expected(s.table), f"{s.pod}'s view differs from its store"


def test_a_router_rebuilds_each_servers_holdings_and_picks_the_holder(
    fleet: tuple[list[Server], Subscriber],
) -> None:
    servers, sub = fleet
    a, b = servers
    holdings, index, dynamo = Holdings(), LlmdIndex(BS, MODEL), DynamoIndex(BS)
    routers: list[LlmdIndex | DynamoIndex] = [index, dynamo]
    s1 = list(range(100, 114))  # 3 whole pages and a tail of 2
    s2 = list(range(500, 512))
    deliver(servers, sub, holdings, index, dynamo)
    assert holdings.cleared == {a.topic: 1, b.topic: 1}, "a first read announces a clean view"

    pages_s1 = a.store("tenant-a", s1, {Tier.HOST})
    b.store("tenant-b", s2, {Tier.HOST, Tier.DISK})
    deliver(servers, sub, holdings, index, dynamo)
    assert len(holdings.held[a.topic]) == 3, "the tail page is not announced"
    for router in routers:
        assert router.pick([*s1, 7, 7, 7]) == a.pod and router.pick([*s2, 9]) == b.pod
    assert index.scores(s1[:8]) == {a.pod: pytest.approx(1.6)}, "two host blocks at cpu weight 0.8"

    # B's pages leave the host and stay on disk (eviction of the host copy): disk weight only
    for e in b.table.snapshot():
        assert b.table.claim(e.meta.hash, lambda _e: True) is not None
        b.table.settle(e.meta.hash, lambda entry: entry.tiers.discard(Tier.HOST))
    deliver(servers, sub, holdings, index, dynamo)
    assert {m for _, m in holdings.held[b.topic]} == {"STORAGE"}
    assert index.scores(s2) == {b.pod: pytest.approx(3 * 0.4)}

    # erasure of session 1's pages on A: removed, and the router no longer sends its turns there
    a.table.remove(pages_s1)
    deliver(servers, sub, holdings, index, dynamo)
    assert holdings.held[a.topic] == set()
    assert all(router.pick([*s1, 7]) is None for router in routers)
    assert holdings.removed >= 2

    # A's store restarts with session 1 on disk: AllBlocksCleared, then its holdings again
    a.table = PageTable()
    a.events._client = TableClient(a.table)  # the same connector, a new store behind its socket
    a.store("tenant-a", s1, {Tier.DISK})
    deliver(servers, sub, holdings, index, dynamo)
    assert holdings.cleared[a.topic] == 2
    assert all(router.pick([*s1, 7]) == a.pod for router in routers)
    assert all(router.pick([*s2, 7]) == b.pod for router in routers)
    assert dynamo.scores(s1) == {a.pod: 3 * 0.25}, "Dynamo: three blocks at disk credit"
    assert dynamo.skipped_removals == 0, "removals come deepest block first"


def test_events_carry_vllms_fields_and_the_tenant_as_the_first_blocks_salt() -> None:
    table = PageTable()
    events = StoreEvents(TableClient(table), lambda: FID, BS)  # type: ignore[arg-type]
    assert [type(e).__name__ for e in events.take(now=1.0)] == ["AllBlocksCleared"]
    ns = NamespaceId(b"t" * 16)
    hashes = chain_hashes(ns, list(range(8)), BS)
    for i, h in enumerate(hashes):
        meta = PageMeta(h, ns, TenantId("t1"), FID, hashes[i - 1] if i else ROOT_PARENT, i, 8,
                        np.arange(i * BS, (i + 1) * BS, dtype=np.int32))  # fmt: skip
        table.insert(PageEntry(meta, PageStats(0.0, 0, 0.0, i, 8), {Tier.HOST}))
    assert events.take(now=1.05) == [], "polled at most every poll_s"
    first, second = events.take(now=2.0)
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.token_ids == [0, 1, 2, 3] and first.block_size == BS and first.parent_block_hash is None
    assert first.extra_keys == [("t1",)] and second.extra_keys is None
    assert second.parent_block_hash == first.block_hashes[0] == block_hash(hashes[0])
    assert isinstance(first.block_hashes[0], int), "vLLM's default: 64-bit int hashes (llm-d reads uint64)"
    assert (first.medium, first.locality) == ("CPU", "LOCAL")


def test_a_connector_that_turns_off_withdraws_the_stores_pages() -> None:
    """A connector that stops loading (a worker's KV cache does not match the fingerprint) tells
    routers once that this engine holds nothing of the store's, then stays quiet."""
    table = PageTable()
    on = [True]
    events = StoreEvents(TableClient(table), lambda: FID if on[0] else None, BS, poll_s=0.0)  # type: ignore[arg-type]
    assert [type(e).__name__ for e in events.take()] == ["AllBlocksCleared"]
    on[0] = False
    assert [type(e).__name__ for e in events.take()] == ["AllBlocksCleared"]
    assert events.take() == [] and events.take() == []
