"""Hypothesis state machine: the radix trie against a set of page-prefix tuples."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dss.index.hashing import chain_hashes
from dss.index.trie import RadixTrie
from dss.types import NamespaceId, PageHash

NS = NamespaceId(b"s" * 16)
# A three-letter alphabet makes prefixes collide often, so splits and merges happen a lot.
TOKENS = st.lists(st.integers(min_value=0, max_value=2), min_size=2, max_size=18)

Prefix = tuple[int, ...]


class TrieMachine(RuleBasedStateMachine):
    """The model: every indexed page is the tuple of tokens up to and including it."""

    page_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.trie = RadixTrie(self.page_size)
        self.model: set[Prefix] = set()

    def prefixes(self, tokens: list[int]) -> list[Prefix]:
        ps = self.page_size
        return [tuple(tokens[: (i + 1) * ps]) for i in range(len(tokens) // ps)]

    def hash_of(self, prefix: Prefix) -> PageHash:
        return chain_hashes(NS, list(prefix), self.page_size)[-1]

    def expected_match(self, tokens: list[int]) -> list[Prefix]:
        out = []
        for p in self.prefixes(tokens):
            if p not in self.model:
                break
            out.append(p)
        return out

    @rule(tokens=TOKENS)
    def insert(self, tokens: list[int]) -> None:
        self._insert(tokens)

    def _insert(self, tokens: list[int]) -> None:
        present = len(self.expected_match(tokens)) * self.page_size
        assert self.trie.insert(tokens, chain_hashes(NS, tokens, self.page_size)) == present
        self.model.update(self.prefixes(tokens))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), suffix=TOKENS)
    def extend(self, data: st.DataObject, suffix: list[int]) -> None:
        """Insert an indexed prefix plus new tokens: deep trees, leaf extensions and branching."""
        base = data.draw(st.sampled_from(sorted(self.model)))
        self._insert(list(base) + suffix)

    @rule(tokens=TOKENS)
    def match(self, tokens: list[int]) -> None:
        expected = self.expected_match(tokens)
        m = self.trie.match(tokens)
        assert m.n_tokens == len(expected) * self.page_size
        assert list(m.pages) == chain_hashes(NS, tokens, self.page_size)[: len(expected)]
        if expected:
            assert m.pages[-1] in m.node.pages
        else:
            assert m.node is self.trie.root

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove_from(self, data: st.DataObject) -> None:
        start = data.draw(st.sampled_from(sorted(self.model)))
        doomed = {p for p in self.model if p[: len(start)] == start}
        removed = self.trie.remove_from(self.hash_of(start))
        assert len(removed) == len(doomed)
        assert set(removed) == {self.hash_of(p) for p in doomed}
        self.model -= doomed

    @invariant()
    def consistent(self) -> None:
        self.trie.check()
        assert len(self.trie) == len(self.model) * self.page_size
        assert set(self.trie.iter_pages()) == {self.hash_of(p) for p in self.model}


class TrieMachinePage4(TrieMachine):
    page_size = 4


_SETTINGS = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestTriePage2 = TrieMachine.TestCase
TestTriePage2.settings = _SETTINGS
TestTriePage4 = TrieMachinePage4.TestCase
TestTriePage4.settings = _SETTINGS
