"""Unit tests of the token radix trie with exact expectations."""

from __future__ import annotations

import numpy as np
import pytest

from dss.errors import InvalidInput, NotFoundError
from dss.index.hashing import chain_hashes
from dss.index.trie import RadixTrie
from dss.types import NamespaceId, PageHash

NS = NamespaceId(b"n" * 16)
OTHER_NS = NamespaceId(b"o" * 16)
PS = 4


def seq(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def run(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def hashes(tokens: list[int] | np.ndarray, ns: NamespaceId = NS) -> list[PageHash]:
    return chain_hashes(ns, tokens, PS)


def insert(trie: RadixTrie, tokens: list[int]) -> int:
    return trie.insert(tokens, hashes(tokens))


def test_empty_trie_matches_nothing() -> None:
    trie = RadixTrie(PS)
    m = trie.match(run(12))
    assert (m.n_tokens, m.pages, m.n_pages) == (0, (), 0)
    assert m.node is trie.root
    assert len(trie) == 0 and trie.n_pages == 0
    trie.check()


def test_page_size_must_be_positive() -> None:
    with pytest.raises(InvalidInput):
        RadixTrie(0)


def test_insert_then_match_full_and_prefix() -> None:
    trie = RadixTrie(PS)
    toks = run(12)
    h = hashes(toks)
    assert trie.insert(toks, h) == 0
    assert len(trie) == 12 and trie.n_pages == 3 and trie.n_nodes == 1
    full = trie.match(toks)
    assert full.n_tokens == 12 and full.pages == tuple(h)
    longer = trie.match(run(20))
    assert longer.n_tokens == 12 and longer.pages == tuple(h)
    shorter = trie.match(run(8))
    assert shorter.n_tokens == 8 and shorter.pages == tuple(h[:2])
    assert full.node is shorter.node
    assert list(trie.match(run(9), touch=False).pages) == h[:2]
    assert all(p in trie for p in h)
    assert list(trie.iter_pages()) == h
    trie.check()


def test_partial_last_page_is_ignored() -> None:
    trie = RadixTrie(PS)
    toks = run(10)  # two full pages and two stray tokens
    assert trie.insert(toks, hashes(toks)) == 0
    assert len(trie) == 8 and trie.n_pages == 2
    with pytest.raises(InvalidInput):
        trie.insert(toks, hashes(run(12)))
    m = trie.match(run(11))
    assert m.n_tokens == 8 and m.pages == tuple(hashes(run(8)))
    assert trie.match(run(3)).n_tokens == 0
    trie.check()


def test_split_at_divergence_mid_node() -> None:
    trie = RadixTrie(PS)
    a = run(16)
    b = run(8) + run(8, start=100)
    insert(trie, a)
    assert insert(trie, b) == 8
    assert trie.n_nodes == 3 and trie.n_pages == 6
    (head,) = trie.root.children.values()
    assert head.key.tolist() == run(8) and head.pages == hashes(a)[:2]
    assert sorted(c.key.tolist() for c in head.children.values()) == [run(8, 8), run(8, 100)]
    ma, mb = trie.match(a), trie.match(b)
    assert ma.pages == tuple(hashes(a)) and mb.pages == tuple(hashes(b))
    assert ma.node is not mb.node and ma.node.parent is head and mb.node.parent is head
    trie.check()


def test_divergence_inside_a_page_floors_to_page_before() -> None:
    trie = RadixTrie(PS)
    a = run(16)
    insert(trie, a)
    probe = run(16)
    probe[9] = 999  # inside page 2
    m = trie.match(probe)
    assert m.n_tokens == 8 and m.pages == tuple(hashes(a)[:2])
    # the same divergence on insert splits at the page boundary before it
    assert insert(trie, probe) == 8
    assert trie.n_nodes == 3
    assert trie.match(probe).pages == tuple(hashes(probe))
    trie.check()


def test_divergence_in_first_page_makes_a_sibling() -> None:
    trie = RadixTrie(PS)
    insert(trie, run(8))
    other = [0, 1, 2, 7, 4, 5, 6, 7]
    assert trie.match(other).n_tokens == 0
    assert insert(trie, other) == 0
    assert len(trie.root.children) == 2 and trie.n_pages == 4
    trie.check()


def test_insert_returns_already_present_count() -> None:
    trie = RadixTrie(PS)
    assert insert(trie, run(8)) == 0
    assert insert(trie, run(8)) == 8
    assert insert(trie, run(4)) == 4
    assert insert(trie, run(6)) == 4
    assert insert(trie, run(20)) == 8
    assert insert(trie, run(12) + run(4, 50)) == 12
    assert trie.n_pages == 6
    trie.check()


def test_extending_a_leaf_keeps_one_node() -> None:
    trie = RadixTrie(PS)
    insert(trie, run(8))
    insert(trie, run(16))
    insert(trie, run(24))
    assert trie.n_nodes == 1
    (node,) = trie.root.children.values()
    assert node.key.tolist() == run(24) and node.pages == hashes(run(24))
    trie.check()


def test_insert_refuses_wrong_counts_and_foreign_hashes() -> None:
    trie = RadixTrie(PS)
    toks = run(12)
    with pytest.raises(InvalidInput):
        trie.insert(toks, hashes(toks)[:2])
    insert(trie, toks)
    before = list(trie.iter_pages())
    # same tokens, hashes of another namespace: a caller bug, refused without changing anything
    foreign = run(8) + run(8, 100)
    with pytest.raises(InvalidInput):
        trie.insert(foreign, hashes(foreign, OTHER_NS))
    # a new page whose hash is already indexed elsewhere
    with pytest.raises(InvalidInput):
        trie.insert(run(4, 200), hashes(toks)[:1])
    assert list(trie.iter_pages()) == before and trie.n_nodes == 1
    trie.check()


def test_remove_from_a_branch_tail_keeps_the_split() -> None:
    trie = RadixTrie(PS)
    a = run(16)
    b = run(8) + run(8, 100)
    insert(trie, a)
    insert(trie, b)
    ha, hb = hashes(a), hashes(b)
    outstanding = trie.match(a)  # a match held by a caller does not stop a removal
    assert trie.remove_from(hb[3]) == [hb[3]]  # the branch keeps one page: no merge
    assert trie.n_nodes == 3 and trie.match(b).pages == tuple(hb[:3])
    trie.check()
    assert trie.remove_from(ha[2]) == ha[2:]
    assert trie.n_nodes == 1 and outstanding.node.parent is None  # the merge dropped a's node
    (node,) = trie.root.children.values()
    assert node.pages == hb[:3] and trie.match(a).pages == tuple(ha[:2])
    trie.check()


def test_remove_from_returns_the_subtree_and_stays_valid() -> None:
    trie = RadixTrie(PS)
    a = run(16)
    b = run(8) + run(8, 100)
    c = run(12) + run(8, 300)
    for s in (a, b, c):
        insert(trie, s)
    ha, hb, hc = hashes(a), hashes(b), hashes(c)
    trie.check()
    # from mid-node: the node keeps its first page, its children go
    removed = trie.remove_from(ha[1])
    assert sorted(removed) == sorted(ha[1:] + hb[2:] + hc[3:])
    assert trie.n_pages == 1 and trie.n_nodes == 1 and len(trie) == 4
    assert trie.match(a).pages == (ha[0],)
    assert all(h not in trie for h in removed)
    with pytest.raises(NotFoundError):
        trie.remove_from(ha[1])
    trie.check()
    assert trie.remove_from(ha[0]) == [ha[0]]
    assert trie.n_pages == 0 and trie.n_nodes == 0 and trie.root.children == {}
    trie.check()


def test_removed_nodes_are_detached() -> None:
    trie = RadixTrie(PS)
    insert(trie, run(8))
    m = trie.match(run(8))
    trie.remove_from(m.pages[0])
    assert m.node.parent is None and m.node.children == {}
    assert trie.match(run(8)).node is trie.root
    trie.check()


def test_removing_a_branch_merges_the_chain() -> None:
    trie = RadixTrie(PS)
    a = run(16)
    b = run(8) + run(8, 100)
    insert(trie, a)
    insert(trie, b)
    assert trie.n_nodes == 3
    hb = hashes(b)
    assert trie.remove_from(hb[2]) == hb[2:]
    assert trie.n_nodes == 1
    (node,) = trie.root.children.values()
    assert node.key.tolist() == a and node.pages == hashes(a)
    trie.check()


def test_merge_keeps_the_parent_side_node() -> None:
    trie = RadixTrie(PS)
    a = run(16)
    b = run(8) + run(8, 100)
    insert(trie, a)
    insert(trie, b)
    head = trie.match(run(8)).node
    tail = trie.match(a).node
    assert head.pages == hashes(a)[:2] and tail.parent is head
    trie.remove_from(hashes(b)[2])
    # the head absorbs its remaining child and keeps its place under the root
    assert trie.n_nodes == 1 and head.parent is trie.root and head.pages == hashes(a)
    assert head.key.tolist() == a and trie.match(a, touch=False).node is head
    assert tail.parent is None and tail.children == {}
    assert head.hit_count >= tail.hit_count and head.last_access >= tail.last_access
    trie.check()


def test_merge_reparents_the_absorbed_childs_children() -> None:
    trie = RadixTrie(PS)
    a = run(24)
    b = run(8) + run(8, 100)
    c = run(16) + run(8, 300)
    for s in (a, b, c):
        insert(trie, s)
    # root -> [0,8) -> {b's tail, [8,16) -> {a's tail, c's tail}}
    assert trie.n_nodes == 5
    trie.remove_from(hashes(b)[2])
    assert trie.n_nodes == 3
    (head,) = trie.root.children.values()
    assert head.key.tolist() == run(16) and head.pages == hashes(a)[:4]
    assert len(head.children) == 2 and all(ch.parent is head for ch in head.children.values())
    assert trie.match(a).pages == tuple(hashes(a)) and trie.match(c).pages == tuple(hashes(c))
    trie.check()


def test_match_touch_updates_stats_only_when_asked() -> None:
    trie = RadixTrie(PS)
    insert(trie, run(8))
    node = trie.match(run(8)).node
    hits, seen = node.hit_count, node.last_access
    trie.match(run(8), touch=False)
    assert (node.hit_count, node.last_access) == (hits, seen)
    trie.match(run(8))
    assert node.hit_count == hits + 1 and node.last_access >= seen


def test_nbytes_grows_with_content() -> None:
    trie = RadixTrie(PS)
    empty = trie.nbytes()
    insert(trie, run(400))
    assert trie.nbytes() > empty + 100 * 32
