"""The version store against a plain-dict model, driven by hypothesis (SQLite)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import make_engine, make_session_factory, upgrade_to_head
from dss.dialogue.versions import VersionStore
from dss.errors import (
    BranchExists,
    BranchNotFound,
    NotAnAncestor,
    SessionNotFound,
    StaleHead,
    VersionNotFound,
)

USERS = ("u1", "u2")
BRANCH_NAMES = ("main", "b1", "b2", "b3")


@dataclass
class ModelSession:
    user: str
    heads: dict[str, int] = field(default_factory=lambda: {"main": 0})
    parents: dict[int, int | None] = field(default_factory=dict)
    branch_of: dict[int, str] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)

    def chain(self, n: int) -> list[int]:
        out: list[int] = []
        cur: int | None = n
        while cur:
            out.append(cur)
            cur = self.parents[cur]
        return out


class VersionStoreMachine(RuleBasedStateMachine):
    factory: ClassVar[sessionmaker[Session] | None] = None

    sessions = Bundle("sessions")

    def __init__(self) -> None:
        super().__init__()
        assert self.factory is not None
        self.store = VersionStore(self.factory)
        # Every example shares one database; a fresh user prefix keeps examples apart.
        self.prefix = uuid.uuid4().hex[:8]
        self.model: dict[str, ModelSession] = {}
        self.order: list[str] = []

    def user(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    @rule(target=sessions, who=st.sampled_from(USERS))
    def create(self, who: str) -> str:
        info = self.store.create_session(self.user(who))
        self.model[info.id] = ModelSession(user=who)
        self.order.append(info.id)
        return info.id

    @rule(sid=sessions, data=st.data(), tokens=st.lists(st.integers(0, 2**31 - 1), max_size=5))
    def commit(self, sid: str, data: st.DataObject, tokens: list[int]) -> None:
        m = self.model.get(sid)
        if m is None:
            with pytest.raises(SessionNotFound):
                self.store.commit(self.user("u1"), sid, tokens=tokens, messages=[])
            return
        branch = data.draw(st.sampled_from(sorted(m.heads)))
        head = m.heads[branch]
        expected = data.draw(st.sampled_from([None, head, head + 1]))
        if expected is not None and expected != head:
            with pytest.raises(StaleHead):
                self.store.commit(
                    self.user(m.user), sid, tokens=tokens, messages=[], branch=branch, expected_head=expected
                )
            return
        v = self.store.commit(
            self.user(m.user), sid, tokens=tokens, messages=[], branch=branch, expected_head=expected
        )
        assert v.number == len(m.parents) + 1
        m.parents[v.number] = head or None
        m.branch_of[v.number] = branch
        m.tokens[v.number] = tokens
        m.heads[branch] = v.number

    @rule(sid=sessions, data=st.data())
    def rollback(self, sid: str, data: st.DataObject) -> None:
        m = self.model.get(sid)
        if m is None:
            return
        branch = data.draw(st.sampled_from(sorted(m.heads)))
        target = data.draw(st.integers(1, len(m.parents) + 1))
        user = self.user(m.user)
        if target not in m.parents:
            with pytest.raises(VersionNotFound):
                self.store.rollback(user, sid, branch, target)
        elif target not in m.chain(m.heads[branch]):
            with pytest.raises(NotAnAncestor):
                self.store.rollback(user, sid, branch, target)
        else:
            assert self.store.rollback(user, sid, branch, target).head_version == target
            m.heads[branch] = target

    @rule(sid=sessions, data=st.data(), name=st.sampled_from(BRANCH_NAMES))
    def branch(self, sid: str, data: st.DataObject, name: str) -> None:
        m = self.model.get(sid)
        if m is None:
            return
        source = data.draw(st.integers(1, len(m.parents) + 1))
        user = self.user(m.user)
        if source not in m.parents:
            with pytest.raises(VersionNotFound):
                self.store.branch(user, sid, source, name)
        elif name in m.heads:
            with pytest.raises(BranchExists):
                self.store.branch(user, sid, source, name)
        else:
            assert self.store.branch(user, sid, source, name).head_version == source
            m.heads[name] = source

    @rule(sid=sessions)
    def intruder_sees_nothing(self, sid: str) -> None:
        m = self.model.get(sid)
        other = "u2" if m is None or m.user == "u1" else "u1"
        with pytest.raises(SessionNotFound):
            self.store.list_versions(self.user(other), sid)

    @rule(sid=sessions)
    def missing_branch(self, sid: str) -> None:
        m = self.model.get(sid)
        if m is not None:
            with pytest.raises(BranchNotFound):
                self.store.get_branch(self.user(m.user), sid, "no-such-branch")

    @rule(sid=sessions)
    def delete(self, sid: str) -> None:
        m = self.model.pop(sid, None)
        if m is None:
            return
        assert self.store.delete_session(self.user(m.user), sid) == len(m.parents)
        self.order.remove(sid)

    @invariant()
    def matches_model(self) -> None:
        for who in USERS:
            listed, more = self.store.list_sessions(self.user(who), limit=1000)
            assert not more
            assert [s.id for s in listed] == [sid for sid in self.order if self.model[sid].user == who]
            for s in listed:
                m = self.model[s.id]
                assert {b.name: b.head_version for b in s.branches} == m.heads
                assert s.version_count == len(m.parents)
                versions = self.store.list_versions(self.user(who), s.id)
                assert {v.number: v.parent for v in versions} == m.parents
                assert {v.number: v.branch for v in versions} == m.branch_of

    def teardown(self) -> None:
        for sid, m in self.model.items():
            full = self.store.list_versions(self.user(m.user), sid, with_body=True)
            assert {v.number: v.tokens.tolist() for v in full} == m.tokens
            for n in m.parents:
                assert self.store.ancestors(self.user(m.user), sid, n) == m.chain(n)
        assert self.store.check() == []


def test_version_store_matches_dict_model(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'sm.sqlite3'}"
    upgrade_to_head(url)
    engine = make_engine(url)
    try:
        VersionStoreMachine.factory = make_session_factory(engine)
        run_state_machine_as_test(
            VersionStoreMachine,
            settings=settings(max_examples=50, stateful_step_count=25, deadline=None),
        )
    finally:
        VersionStoreMachine.factory = None
        engine.dispose()
