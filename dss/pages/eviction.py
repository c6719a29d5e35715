"""Eviction policies: small strategies that each answer one question, the priority of a page.

A LOWER priority is evicted FIRST. Policies are chosen by name from `POLICIES`; `choose_victims`
turns a policy and a set of candidate pages into an eviction order.

Above every policy sits the page's retention class (`RetentionClass`, set from the session hints by
`dss.ops.retention`): pages are evicted class by class, lowest first (pages only versions off
every branch reach, then pages of `evict` sessions, then the rest), and the policy orders the
pages within a class. `PINNED` pages, like pinned public prefixes, are never chosen. A store
whose pages all keep the default class (`NORMAL`) evicts exactly in the policy's order.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar, Protocol, runtime_checkable

from dss.errors import InvalidInput
from dss.types import PageHash


class RetentionClass(IntEnum):
    """A page's retention class; lower classes are evicted first (the value is the order)."""

    ORPHAN = 0  # only versions that no branch head leads to reach it (after a rollback)
    EVICT = 1  # of sessions whose hint is `evict` (and of no `normal` or `pinned` one)
    NORMAL = 2  # the default
    PINNED = 3  # of a `pinned` session: never chosen for eviction


@dataclass(slots=True)
class PageStats:
    """What a policy may know about one page."""

    last_access: float  # time.monotonic() of the last hit (or of creation)
    hits: int
    created: float
    index: int  # position of the page in its sequence (0 = first page)
    nbytes: int
    pinned: bool = False
    retention: RetentionClass = RetentionClass.NORMAL


@runtime_checkable
class EvictionPolicy(Protocol):
    name: ClassVar[str]

    def priority(self, stats: PageStats, now: float) -> float:
        """Keep-worthiness of a page at time `now`; lower is evicted first. Pure, no side effects."""
        ...


class LRUPolicy:
    """Least recently used goes first."""

    name: ClassVar[str] = "lru"

    def priority(self, stats: PageStats, now: float) -> float:
        return stats.last_access


class LFUPolicy:
    """Fewest hits goes first; among equal hits, the least recently used.

    The recency tie-break is a fraction in (0, 0.5] that shrinks with age, so it orders pages of
    equal hits without ever outweighing one hit.
    """

    name: ClassVar[str] = "lfu"

    def priority(self, stats: PageStats, now: float) -> float:
        age = max(0.0, now - stats.last_access)
        return stats.hits + 1.0 / (2.0 + age)


class CostAwarePolicy:
    """Expected recompute time saved per byte kept; the cheapest to lose goes first.

    A page is worth keeping in proportion to how likely it is to be used again and to what it would
    cost to recompute, and in inverse proportion to the bytes it holds:

        value = (1 + hits) ** freq_weight            # frequency
              * 0.5 ** (age / half_life_s)           # recency: halves every half_life_s of idleness
              * (1 + depth_weight * index)           # recompute cost
              / nbytes ** size_weight                # per byte freed

    The recompute term: prefilling page `index` costs the per-token linear layers (a constant) plus
    attention over the `index * page_size` tokens before it, so cost grows linearly with the index.
    `depth_weight` is attention's share relative to the linear layers per page of context, about
    page_size / (6 * d_model): 0.005 fits a small model (d_model ~ 576) at page_size 16; large
    models want less. The priority returned is log(value), which orders the same and cannot
    overflow.
    """

    name: ClassVar[str] = "cost"

    def __init__(
        self,
        freq_weight: float = 1.0,
        half_life_s: float = 600.0,
        depth_weight: float = 0.005,
        size_weight: float = 1.0,
    ) -> None:
        if half_life_s <= 0:
            raise InvalidInput("half_life_s must be positive")
        if freq_weight < 0 or depth_weight < 0 or size_weight < 0:
            raise InvalidInput("policy weights must not be negative")
        self.freq_weight = freq_weight
        self.half_life_s = half_life_s
        self.depth_weight = depth_weight
        self.size_weight = size_weight
        self._decay_per_s = math.log(2.0) / half_life_s

    def priority(self, stats: PageStats, now: float) -> float:
        age = max(0.0, now - stats.last_access)
        return (
            self.freq_weight * math.log1p(max(0, stats.hits))
            - self._decay_per_s * age
            + math.log1p(self.depth_weight * max(0, stats.index))
            - self.size_weight * math.log(max(1, stats.nbytes))
        )


POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    LFUPolicy.name: LFUPolicy,
    CostAwarePolicy.name: CostAwarePolicy,
}


def make_policy(name: str, **params: Any) -> EvictionPolicy:
    """The policy registered under `name`, built with `params` (e.g. CostAwarePolicy's weights)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidInput(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    try:
        return cls(**params)
    except TypeError as exc:
        raise InvalidInput(f"bad parameters for eviction policy {name!r}: {exc}") from exc


def choose_victims(
    candidates: Iterable[tuple[PageHash, PageStats]],
    policy: EvictionPolicy,
    now: float,
    need_bytes: int,
) -> list[PageHash]:
    """Unpinned candidates in eviction order, until their bytes reach `need_bytes` (or all of them):
    by retention class first (lowest first), then by the policy's priority.

    Equal priorities keep the candidates' order, so the result is deterministic.
    """
    if need_bytes <= 0:
        return []
    heap = [
        (int(stats.retention), policy.priority(stats, now), seq, page, stats.nbytes)
        for seq, (page, stats) in enumerate(candidates)
        if not stats.pinned and stats.retention is not RetentionClass.PINNED
    ]
    heapq.heapify(heap)
    victims: list[PageHash] = []
    freed = 0
    while heap and freed < need_bytes:
        _, _, _, page, nbytes = heapq.heappop(heap)
        victims.append(page)
        freed += nbytes
    return victims
