"""The store's host and disk pages as vLLM KV events, for KV-aware routers.

vLLM publishes what its scheduler's connector returns from `take_events()` with its own events,
through its own publisher (`--kv-events-config`, ZMQ PUB). `StoreEvents` reads the page events of
the engine's fingerprint from the store (`EngineStore.take_events`, at most every `poll_s`, so an
engine step does not pay a round trip each time) and converts them with vLLM's own classes:

- a page stored durably in the host arena is `BlockStored(medium="CPU", locality="LOCAL")`, on disk
  `BlockStored(medium="STORAGE", locality="LOCAL")`; one event per page (a page is one engine
  block), with its `token_ids`, `block_size`, `parent_block_hash` (None for a sequence's first
  block) and, on the first block, the page's tenant as `extra_keys` (where vLLM puts a request's
  `cache_salt`). Block hashes are the store's page hashes (blake2b chained over the namespace,
  the parent and the tokens) through vLLM's `maybe_convert_block_hash` (64-bit ints by default),
  so a page has one hash on every tier and across restarts;
- a page a tier let go (eviction, demotion, erasure) is `BlockRemoved` with that medium;
- a resync (first read, a restarted or wiped store, events dropped from the store's bounded
  queue) is `AllBlocksCleared` followed by every page the store holds for the fingerprint.

Tail pages (a sequence's partial last block) are not announced: routers match whole blocks only.
A store that does not answer is retried at the next poll; nothing is lost (the reader's cursor
stays where it was).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from dss.errors import DSSError
from dss.types import FingerprintId, Tier
from dss.wire import PAGE_STORED, PageEvent, PageEventBatch

if TYPE_CHECKING:
    from collections.abc import Callable

    from vllm.distributed.kv_events import ExternalBlockHash

    from dss.rpc import StoreClient

logger = init_logger("vllm.dss_connector")

MEDIUM_OF_TIER = {Tier.HOST.value: MEDIUM_CPU, Tier.DISK.value: MEDIUM_STORAGE}
LOCALITY = "LOCAL"


def block_hash(page: bytes) -> ExternalBlockHash:
    """The KV-event hash of a store page (vLLM's conversion, as for its own blocks)."""
    return maybe_convert_block_hash(BlockHash(page))


def to_vllm_events(batch: PageEventBatch, block_size: int) -> list[KVCacheEvent]:
    """vLLM KV events for one answer of the store (see the module docstring)."""
    out: list[KVCacheEvent] = [AllBlocksCleared()] if batch.resync else []
    for ev in _children_first(batch.events):
        medium = MEDIUM_OF_TIER.get(ev.tier)
        if medium is None or ev.n_tokens != block_size:
            continue  # another tier, or a tail page
        out.append(_stored(ev, medium, block_size) if ev.kind == PAGE_STORED else _removed(ev, medium))
    return out


def _children_first(events: tuple[PageEvent, ...]) -> list[PageEvent]:
    """The events in order, except that each run of consecutive removals is sorted deepest page
    first: a router's radix tree (Dynamo's) drops a block's descendants with it, and then refuses
    their own removals. Removals commute, so the state after the run is the same."""
    out: list[PageEvent] = []
    run: list[PageEvent] = []
    for ev in events:
        if ev.kind == PAGE_STORED:
            out.extend(sorted(run, key=lambda e: -e.index))
            run = []
            out.append(ev)
        else:
            run.append(ev)
    out.extend(sorted(run, key=lambda e: -e.index))
    return out


def _stored(ev: PageEvent, medium: str, block_size: int) -> BlockStored:
    return BlockStored(
        block_hashes=[block_hash(ev.page)],
        parent_block_hash=block_hash(ev.parent) if ev.parent is not None else None,
        token_ids=list(ev.tokens),
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        # vLLM's own events carry the cache salt untagged on the first block
        extra_keys=[(ev.tenant,)] if ev.index == 0 else None,
        locality=LOCALITY,
    )


def _removed(ev: PageEvent, medium: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=[block_hash(ev.page)], medium=medium, locality=LOCALITY)


class StoreEvents:
    """Reads the store's page events for one fingerprint and hands them to vLLM as KV events."""

    def __init__(
        self,
        client: StoreClient,
        fid: Callable[[], FingerprintId | None],
        block_size: int,
        *,
        poll_s: float = 0.1,
        limit: int = 4096,
        timeout_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._fid = fid
        self.block_size = block_size
        self.poll_s = poll_s
        self.limit = limit
        self.timeout_s = timeout_s
        self._clock = clock
        self._epoch = ""  # no epoch yet: the first read is a resync
        self._after = 0
        self._next_poll = 0.0
        self.published = 0
        self.resyncs = 0
        self.errors = 0
        self.dropped = 0  # events the store's queue dropped for this fingerprint (each: a resync)

    def take(self, *, now: float | None = None) -> list[KVCacheEvent]:
        now = self._clock() if now is None else now
        if now < self._next_poll:
            return []
        self._next_poll = now + self.poll_s
        fid = self._fid()
        if fid is None:
            if not self._epoch:
                return []
            # the connector went off (or the store no longer knows this engine): this engine
            # loads nothing from the store any more, so a router must not count its pages here
            logger.warning("DSS KV events: the connector is off; the store's pages are withdrawn")
            self.resync()
            return [AllBlocksCleared()]
        try:
            batch = self._client.take_events(
                fid, self._epoch, self._after, self.limit, timeout_s=self.timeout_s
            )
        except DSSError as exc:
            self.errors += 1
            if self.errors == 1 or self.errors % 100 == 0:
                logger.warning("DSS KV events: the store did not answer (%d times): %s", self.errors, exc)
            return []
        if batch.resync:
            self.resyncs += 1
            if self._epoch:
                logger.info(
                    "DSS KV events: resync (store epoch %s, %d events dropped so far)",
                    batch.epoch,
                    batch.dropped,
                )
        self._epoch, self._after, self.dropped = batch.epoch, batch.last_id, batch.dropped
        if batch.more:
            self._next_poll = now  # more waiting: read again at the next step
        events = to_vllm_events(batch, self.block_size)
        self.published += len(events)
        return events

    def resync(self) -> None:
        """Publish `AllBlocksCleared` and every page the store holds at the next poll."""
        self._epoch, self._after, self._next_poll = "", 0, 0.0

    def close(self) -> None:
        self._client.close()
