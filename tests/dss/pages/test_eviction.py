"""Eviction policies: exact orders on hand-made stats, pins, byte targets and the registry."""

from __future__ import annotations

import pytest

from dss.errors import InvalidInput
from dss.pages.eviction import (
    POLICIES,
    CostAwarePolicy,
    EvictionPolicy,
    LFUPolicy,
    LRUPolicy,
    PageStats,
    choose_victims,
    make_policy,
)
from dss.types import PageHash

NOW = 10_000.0
MIB = 1 << 20


def ph(name: str) -> PageHash:
    return PageHash(name.encode().ljust(32, b"\0"))


def stats(age: float, hits: int, index: int = 0, nbytes: int = MIB, pinned: bool = False) -> PageStats:
    return PageStats(
        last_access=NOW - age, hits=hits, created=NOW - 5000, index=index, nbytes=nbytes, pinned=pinned
    )


# name: (seconds since last access, hits, page index)
SET = {
    "old_popular": stats(age=900, hits=50, index=3),
    "fresh_once": stats(age=1, hits=1, index=0),
    "mid_twice": stats(age=100, hits=2, index=1),
    "old_twice": stats(age=500, hits=2, index=1),
    "deep_rare": stats(age=60, hits=1, index=4000),
}


def order(policy: EvictionPolicy, pages: dict[str, PageStats] = SET) -> list[str]:
    cands = [(ph(n), s) for n, s in pages.items()]
    victims = choose_victims(cands, policy, NOW, need_bytes=10**12)
    return [v.rstrip(b"\0").decode() for v in victims]


def test_lru_order() -> None:
    assert order(LRUPolicy()) == ["old_popular", "old_twice", "mid_twice", "deep_rare", "fresh_once"]


def test_lfu_order_breaks_ties_by_recency() -> None:
    assert order(LFUPolicy()) == ["deep_rare", "fresh_once", "old_twice", "mid_twice", "old_popular"]


def test_cost_aware_order() -> None:
    # log-values: old_twice 0.53 < fresh_once 0.69 < mid_twice 0.99 < old_popular 2.91 < deep_rare 3.67.
    # 51x for 50 hits beats the 2.8x decay of 15 idle minutes; a page at index 4000 costs 21x a
    # first page to recompute, which outweighs everything else here.
    assert order(CostAwarePolicy()) == ["old_twice", "fresh_once", "mid_twice", "old_popular", "deep_rare"]


def test_cost_aware_weights_change_the_order() -> None:
    recency_only = CostAwarePolicy(freq_weight=0.0, depth_weight=0.0, half_life_s=60.0)
    assert order(recency_only) == order(LRUPolicy())
    no_depth = CostAwarePolicy(depth_weight=0.0)
    assert order(no_depth) == ["old_twice", "deep_rare", "fresh_once", "mid_twice", "old_popular"]


def test_cost_aware_prefers_to_drop_big_pages() -> None:
    pages = {"small": stats(age=10, hits=3, nbytes=MIB), "big": stats(age=10, hits=3, nbytes=4 * MIB)}
    assert order(CostAwarePolicy(), pages) == ["big", "small"]
    assert order(CostAwarePolicy(size_weight=0.0), pages) == ["small", "big"]  # tie: input order


def test_cost_aware_rejects_bad_weights() -> None:
    with pytest.raises(InvalidInput):
        CostAwarePolicy(half_life_s=0)
    with pytest.raises(InvalidInput):
        CostAwarePolicy(depth_weight=-1)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_pinned_pages_are_never_chosen(name: str) -> None:
    pages = dict(SET)
    pages["pinned_cold"] = stats(age=10**6, hits=0, index=0, pinned=True)
    victims = order(make_policy(name), pages)
    assert "pinned_cold" not in victims and len(victims) == len(SET)


def test_need_bytes_stops_at_the_target() -> None:
    cands = [(ph(n), s) for n, s in SET.items()]
    assert choose_victims(cands, LRUPolicy(), NOW, need_bytes=0) == []
    assert choose_victims(cands, LRUPolicy(), NOW, need_bytes=1) == [ph("old_popular")]
    assert choose_victims(cands, LRUPolicy(), NOW, need_bytes=MIB) == [ph("old_popular")]
    assert choose_victims(cands, LRUPolicy(), NOW, need_bytes=MIB + 1) == [ph("old_popular"), ph("old_twice")]
    assert len(choose_victims(cands, LRUPolicy(), NOW, need_bytes=100 * MIB)) == len(SET)


def test_make_policy_by_name() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("lfu"), LFUPolicy)
    cost = make_policy("cost", half_life_s=30.0)
    assert isinstance(cost, CostAwarePolicy) and cost.half_life_s == 30.0
    assert all(isinstance(make_policy(n), EvictionPolicy) for n in POLICIES)
    assert {POLICIES[n].name for n in POLICIES} == set(POLICIES)


def test_unknown_policy_or_parameter_is_invalid_input() -> None:
    with pytest.raises(InvalidInput):
        make_policy("fifo")
    with pytest.raises(InvalidInput):
        make_policy("lru", half_life_s=3.0)
