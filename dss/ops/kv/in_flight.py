"""The KV cache's records of work in flight: a load's lease (guarded by `KVLoads._lock`) and a
pending save (guarded by `KVSaves._lock`); nothing here locks."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from dss.pages.table import Held
from dss.types import FingerprintId, Namespace, PageHash
from dss.wire import PageSlot, SlotRef


@dataclass
class Lease:
    held: list[Held]  # every page pinned by the lease (from page 0)
    plan_pages: tuple[PageSlot, ...]
    futures: dict[int, Future[SlotRef | None]]
    shards: int = 1  # engine ranks that each copy their shard and release (`release(..., shard)`)
    released: set[int] = field(default_factory=set)
    created: float = field(default_factory=time.monotonic)


@dataclass
class PendingSave:
    fingerprint: FingerprintId
    namespace: Namespace
    tokens: np.ndarray
    hashes: list[PageHash]
    namespaces: list[Namespace]
    slots: dict[int, SlotRef]
    shards: int = 1  # engine ranks that each copy their shard and report (commit or abort)
    # Each rank's report: the page indexes it copied (an abort copied none). The save is
    # published, or freed, only when every rank reported: until then a rank may still be
    # writing into the slots, which must not be reused.
    reports: dict[int, frozenset[int]] = field(default_factory=dict)
    created: float = field(default_factory=time.monotonic)
    # Set while an erasure zeroes the slots (guarded by KVSaves._lock): a commit or abort that
    # arrives meanwhile only marks `reported`, and the eraser frees the slots when it is done.
    scrubbing: bool = False
    reported: bool = False
