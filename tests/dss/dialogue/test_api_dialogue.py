"""Where a chat turn attaches and how it is committed (dss.dialogue.turns), on a real version store."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from sqlalchemy.orm import Session, sessionmaker

from dss.dialogue.turns import TurnTarget, chat_target, commit_turn, message_target
from dss.dialogue.versions import VersionStore
from dss.errors import ConflictError, StaleHead, VersionNotFound
from dss.types import SessionId


@pytest.fixture
def vs(session_factory: sessionmaker[Session]) -> VersionStore:
    return VersionStore(session_factory)


def u(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def a(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def turn(vs: VersionStore, sf: sessionmaker[Session], user: str, sid: str, msgs: list[dict[str, Any]]) -> Any:
    target = chat_target(vs, user, sid, msgs, None)
    reply = [*msgs, a(f"reply to {msgs[-1]['content']}")]
    return commit_turn(vs, user, target, np.arange(len(reply), dtype=np.int32), reply, "fp"), reply


def test_turns_extend_the_head_and_edits_fork(
    vs: VersionStore, session_factory: sessionmaker[Session]
) -> None:
    sf = session_factory
    c1, m1 = turn(vs, sf, "al", "s", [u("one")])  # the session is created on first use
    assert (c1.version.number, c1.version.parent, c1.branch) == (1, None, "main")
    c2, m2 = turn(vs, sf, "al", "s", [*m1, u("two")])
    assert (c2.version.number, c2.version.parent, c2.branch) == (2, 1, "main")
    # An edited second question attaches to version 1; main keeps its history.
    c3, _ = turn(vs, sf, "al", "s", [*m1, u("TWO")])
    assert (c3.version.number, c3.version.parent) == (3, 1) and c3.branch == "fork-v1"
    c4, _ = turn(vs, sf, "al", "s", [*m1, u("deux")])
    assert c4.version.parent == 1 and c4.branch == "fork-v1-2"
    # An edited first question has no prefix version at all: a fork from the root.
    c5, m5 = turn(vs, sf, "al", "s", [u("uno")])
    assert c5.version.parent is None and c5.branch == "fork-root"
    c6, _ = turn(vs, sf, "al", "s", [*m5, u("dos")])
    assert (c6.version.parent, c6.branch) == (5, "fork-root")
    heads = {b.name: b.head_version for b in vs.list_branches("al", "s")}
    assert heads == {"main": 2, "fork-v1": 3, "fork-v1-2": 4, "fork-root": 6}
    assert vs.check() == []
    assert m2[-1] == a("reply to two")


def test_state_version_must_be_extended_exactly(
    vs: VersionStore, session_factory: sessionmaker[Session]
) -> None:
    c1, m1 = turn(vs, session_factory, "al", "s", [u("one")])
    turn(vs, session_factory, "al", "s", [*m1, u("two")])
    t = chat_target(vs, "al", "s", [*m1, u("again")], state_version=1)
    assert t.parent == 1 and t.branch is None  # main's head is 2: the commit will fork
    with pytest.raises(ConflictError):
        chat_target(vs, "al", "s", [u("other")], state_version=1)
    with pytest.raises(ConflictError):
        chat_target(vs, "al", "s", m1, state_version=1)  # must add at least one message
    with pytest.raises(VersionNotFound):
        chat_target(vs, "al", "s", [*m1, u("x")], state_version=9)
    assert c1.version.number == 1


def test_other_users_sessions_are_invisible(vs: VersionStore, session_factory: sessionmaker[Session]) -> None:
    turn(vs, session_factory, "al", "s", [u("one")])
    # Bob's "s" is a new session of his own: al's history is neither reused nor revealed.
    target = chat_target(vs, "bo", "s", [u("one")], None)
    assert target.parent is None
    with pytest.raises(VersionNotFound):
        chat_target(vs, "bo", "s", [u("one"), u("two")], state_version=1)
    t, base = message_target(vs, "bo", "s", None, None)
    assert t.parent is None and base == []


def test_stateful_target_and_races(vs: VersionStore, session_factory: sessionmaker[Session]) -> None:
    vs.create_session("al", "s", system_prompt="be brief")
    t, base = message_target(vs, "al", "s", None, None)
    assert base == [{"role": "system", "content": "be brief"}] and t == TurnTarget(
        SessionId("s"), None, "main", False
    )
    msgs = [*base, u("q"), a("r")]
    commit_turn(vs, "al", t, np.arange(4, dtype=np.int32), msgs, "fp")
    t2, base2 = message_target(vs, "al", "s", None, None)
    assert t2.parent == 1 and base2 == msgs
    # Another writer moves main first: a branch-pinned stateful turn conflicts (409)...
    vs.commit("al", "s", tokens=[1], messages=[*msgs, u("x"), a("y")])
    with pytest.raises(StaleHead):
        commit_turn(vs, "al", t2, np.arange(6, dtype=np.int32), [*msgs, u("q2"), a("r2")], None)
    # ...while a chat turn, which only names its parent, forks instead.
    t3 = TurnTarget(SessionId("s"), 1, "main", fork_on_race=True)
    c = commit_turn(vs, "al", t3, np.arange(6, dtype=np.int32), [*msgs, u("q3"), a("r3")], None)
    assert c.version.parent == 1 and c.branch == "fork-v1"
    t4, base4 = message_target(vs, "al", "s", None, 1)
    assert t4.parent == 1 and t4.branch is None and base4 == msgs
    assert vs.check() == []
