"""What the scheduler half of the connector tells the worker half each step, and what comes back.

Both cross a process boundary (pickled by vLLM), so they are plain frozen dataclasses of ints and
strings; slots are named by arena path + slot number, never by pointer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from dss.wire import SlotSpan

__all__ = ["DSSConnectorMetadata", "DSSWorkerMetadata", "LoadSpec", "SaveSpec", "SlotSpan"]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Copy host slots into a request's engine blocks.

    `span`: the slots, when every page is in the host arena (the worker copies them at once, in
    `start_load_kv`); None while the store promotes pages (the worker's loader thread asks the
    store for them, `wait_loaded`, which also reports pages that could not be had). `is_async`:
    how vLLM takes the load (a hybrid model's always are), so how a failure is reported: block
    ids for a sync load, the whole request for an async one.
    """

    req_id: str
    load_id: str
    # Per KV cache group, one engine block per page in page order (vLLM's null block, 0, where
    # the group holds no KV for that page's positions: nothing is copied there).
    block_ids: tuple[tuple[int, ...], ...]
    span: SlotSpan | None
    is_async: bool
    # Pages at the front of the store's lease this load leaves out (vLLM's own cache had them):
    # the store's check of an async load counts usable pages from the lease's first.
    skip_pages: int = 0
    # Whether the workers end the lease after copying; False for a load planned by the request's
    # sender, who ends it once the request is answered (no store round trip in the engine).
    release_lease: bool = True

    @property
    def n_pages(self) -> int:
        return len(self.block_ids[0])


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Copy engine blocks into reserved host slots, then commit them.

    `on_finish`: the request has finished and its blocks are held for this copy; the worker
    reports it finished-sending afterwards so vLLM frees them. Prompt pages saved right after
    prefill belong to a running request and need no such report.
    """

    req_id: str
    save_id: str
    page_indexes: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]  # per KV cache group, one engine block per page
    span: SlotSpan
    on_finish: bool = True
    tail_tokens: int = 0  # the last page is a tail page valid for this many tokens (0: it is whole)


@dataclass(slots=True)
class DSSConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class DSSWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, merged across workers: failed load tokens per request, and whether a
    worker turned the connector off (then the scheduler stops matching)."""

    failed_tokens: dict[str, int] = field(default_factory=dict)
    disabled: bool = False

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, DSSWorkerMetadata):
            return self
        merged = dict(self.failed_tokens)
        for req_id, n in other.failed_tokens.items():
            merged[req_id] = max(merged.get(req_id, 0), n)
        return DSSWorkerMetadata(merged, self.disabled or other.disabled)
