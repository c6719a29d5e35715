"""Versioned sessions on SQLite and PostgreSQL: flows, errors, isolation, races, limits."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from dss.dialogue.versions import MAX_TOKENS, VersionInfo, VersionStore
from dss.errors import (
    BranchExists,
    BranchNotFound,
    InvalidInput,
    LimitExceeded,
    NotAnAncestor,
    SessionExists,
    SessionNotFound,
    StaleHead,
    VersionNotFound,
)
from tests.db_helpers import count_user_rows, user_ids_with_data

T = TypeVar("T")
ALICE = "alice"
BOB = "bob"


@pytest.fixture
def store(session_factory: sessionmaker[Session]) -> VersionStore:
    return VersionStore(session_factory)


def msg(role: str, content: str) -> dict[str, Any]:
    return {"role": role, "content": content}


def turns(*contents: str) -> list[dict[str, Any]]:
    """Alternating user/assistant messages."""
    return [msg("user" if i % 2 == 0 else "assistant", c) for i, c in enumerate(contents)]


def store_engine(store: VersionStore) -> Engine:
    engine = store._factory.kw["bind"]  # the test's own store: its engine's pool is what is checked
    assert isinstance(engine, Engine)
    return engine


def heads(store: VersionStore, user: str, sid: str) -> dict[str, int]:
    return {b.name: b.head_version for b in store.list_branches(user, sid)}


def test_create_commit_rollback_branch_flow(store: VersionStore) -> None:
    info = store.create_session(ALICE, "chat-1", system_prompt="be brief", metadata={"title": "t"})
    assert (info.id, info.user_id, info.version_count) == ("chat-1", ALICE, 0)
    assert info.system_prompt == "be brief" and info.metadata == {"title": "t"}
    assert [(b.name, b.head_version, b.is_empty) for b in info.branches] == [("main", 0, True)]
    assert info.created_at.tzinfo is not None

    v1 = store.commit(ALICE, "chat-1", tokens=[1, 2, 3], messages=turns("a"), expected_head=0)
    v2 = store.commit(ALICE, "chat-1", tokens=[1, 2, 3, 4], messages=turns("a", "b"), expected_head=1)
    v3 = store.commit(ALICE, "chat-1", tokens=[1, 2, 3, 4, 5], messages=turns("a", "b", "c"), parent=2)
    assert [(v.number, v.parent, v.branch, v.n_tokens) for v in (v1, v2, v3)] == [
        (1, None, "main", 3),
        (2, 1, "main", 4),
        (3, 2, "main", 5),
    ]
    assert heads(store, ALICE, "chat-1") == {"main": 3}

    rolled = store.rollback(ALICE, "chat-1", "main", 1, expected_head=3)
    assert (rolled.name, rolled.head_version) == ("main", 1)
    assert [v.number for v in store.list_versions(ALICE, "chat-1")] == [1, 2, 3]

    v4 = store.commit(ALICE, "chat-1", tokens=[1, 2, 3, 9], messages=turns("a", "z"))
    assert (v4.number, v4.parent) == (4, 1)
    assert store.ancestors(ALICE, "chat-1", 4) == [4, 1]
    assert store.ancestors(ALICE, "chat-1", 3) == [3, 2, 1]

    alt = store.branch(ALICE, "chat-1", 3, "alt")
    assert (alt.name, alt.head_version) == ("alt", 3)
    v5 = store.commit(ALICE, "chat-1", tokens=[7], messages=turns("a", "b", "c", "d"), branch="alt")
    assert (v5.number, v5.parent, v5.branch) == (5, 3, "alt")
    assert heads(store, ALICE, "chat-1") == {"main": 4, "alt": 5}

    got = store.get_version(ALICE, "chat-1", 5)
    assert isinstance(got, VersionInfo)
    assert got.tokens.dtype == np.dtype("<i4") and not got.tokens.flags.writeable
    assert got.tokens.tolist() == [7]
    assert got.messages == turns("a", "b", "c", "d")
    light = store.get_version(ALICE, "chat-1", 5, with_body=False)
    assert not isinstance(light, VersionInfo) and light.n_tokens == 1
    bodies = store.list_versions(ALICE, "chat-1", with_body=True)
    assert [v.tokens.tolist() for v in bodies] == [
        [1, 2, 3],
        [1, 2, 3, 4],
        [1, 2, 3, 4, 5],
        [1, 2, 3, 9],
        [7],
    ]

    session = store.get_session(ALICE, "chat-1")
    assert session.version_count == 5
    assert session.branch("alt").head_version == 5
    assert session.updated_at >= session.created_at
    assert store.check() == []


def test_errors_name_the_missing_or_conflicting_thing(store: VersionStore) -> None:
    store.create_session(ALICE, "s")
    for _ in range(3):
        store.commit(ALICE, "s", tokens=[1], messages=[])
    store.rollback(ALICE, "s", "main", 1)
    store.commit(ALICE, "s", tokens=[2], messages=[])  # v4, child of 1; 2 and 3 now off main

    with pytest.raises(NotAnAncestor):
        store.rollback(ALICE, "s", "main", 3)
    with pytest.raises(VersionNotFound):
        store.rollback(ALICE, "s", "main", 99)
    with pytest.raises(BranchNotFound):
        store.rollback(ALICE, "s", "nope", 1)
    with pytest.raises(StaleHead):
        store.rollback(ALICE, "s", "main", 1, expected_head=3)
    store.branch(ALICE, "s", 3, "side")
    with pytest.raises(BranchExists):
        store.branch(ALICE, "s", 1, "side")
    with pytest.raises(BranchExists):
        store.branch(ALICE, "s", 1, "main")
    with pytest.raises(VersionNotFound):
        store.branch(ALICE, "s", 42, "other")
    with pytest.raises(BranchNotFound):
        store.commit(ALICE, "s", tokens=[1], messages=[], branch="nope")
    with pytest.raises(BranchNotFound):
        store.get_branch(ALICE, "s", "nope")
    with pytest.raises(VersionNotFound):
        store.get_version(ALICE, "s", 5)
    with pytest.raises(VersionNotFound):
        store.ancestors(ALICE, "s", 0)
    with pytest.raises(StaleHead):
        store.commit(ALICE, "s", tokens=[1], messages=[], expected_head=3)
    with pytest.raises(StaleHead):
        store.commit(ALICE, "s", tokens=[1], messages=[], parent=1)
    with pytest.raises(InvalidInput):
        store.commit(ALICE, "s", tokens=[1], messages=[], parent=4, expected_head=1)
    with pytest.raises(SessionExists):
        store.create_session(ALICE, "s")
    with pytest.raises(SessionNotFound):
        store.get_session(ALICE, "missing")
    for bad in ("", "a b", "x" * 129, "é", "a/b"):
        with pytest.raises(InvalidInput):
            store.create_session(ALICE, bad)
        with pytest.raises(InvalidInput):
            store.branch(ALICE, "s", 1, bad)
    # Failed calls changed nothing.
    assert heads(store, ALICE, "s") == {"main": 4, "side": 3}
    assert store.get_session(ALICE, "s").version_count == 4
    assert store.check() == []


def test_generated_ids_and_ensure_session(store: VersionStore) -> None:
    a = store.create_session(ALICE)
    b = store.create_session(ALICE)
    assert a.id != b.id and a.id.startswith("sess_") and len(a.id) == 5 + 32
    info, created = store.ensure_session(ALICE, "fixed")
    assert created and info.id == "fixed"
    again, created_again = store.ensure_session(ALICE, "fixed")
    assert not created_again and again.created_at == info.created_at
    with pytest.raises(SessionExists):
        store.create_session(ALICE, "fixed")


def test_session_ids_are_per_user(store: VersionStore) -> None:
    # Bob's "trip" is his own: Alice having one neither blocks it nor is visible through it.
    store.create_session(ALICE, "trip")
    alice_v = store.commit(ALICE, "trip", tokens=[1, 2], messages=turns("alice's"))
    bob, created = store.ensure_session(BOB, "trip")
    assert created and bob.version_count == 0
    store.create_session(BOB, "other")
    bob_v = store.commit(BOB, "trip", tokens=[7], messages=turns("bob's"))
    assert alice_v.number == bob_v.number == 1
    assert store.get_version(ALICE, "trip", 1).messages == turns("alice's")
    assert store.get_version(BOB, "trip", 1).messages == turns("bob's")
    assert store.find_deepest_prefix_version(BOB, "trip", turns("alice's")) is None
    store.branch(BOB, "trip", 1, "side")
    assert {b.name for b in store.list_branches(ALICE, "trip")} == {"main"}
    assert store.delete_session(BOB, "trip") == 1
    assert store.get_session(ALICE, "trip").version_count == 1
    assert store.check() == []


def test_messages_are_stored_once_and_rebuilt(
    store: VersionStore, session_factory: sessionmaker[Session]
) -> None:
    from sqlalchemy import select

    from dss.db.connect import transaction
    from dss.db.models import VersionRow

    store.create_session(ALICE, "long")
    history: list[dict[str, str]] = []
    for i in range(30):
        history = [*history, {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
        store.commit(ALICE, "long", tokens=[i], messages=history)
    # An edit that does not extend the head is stored whole, and still rebuilt right.
    edited = [{"role": "user", "content": "other start"}]
    store.commit(ALICE, "long", tokens=[99], messages=edited)
    with transaction(session_factory) as db:
        stored = [
            len(m) for m in db.scalars(select(VersionRow.messages).where(VersionRow.session_id == "long"))
        ]
    assert stored == [2] * 30 + [1]  # linear, not quadratic, in the number of turns
    assert store.get_version(ALICE, "long", 30).messages == history
    assert store.get_version(ALICE, "long", 7).messages == history[:14]
    assert store.get_version(ALICE, "long", 31).messages == edited
    assert [v.messages for v in store.list_versions(ALICE, "long", with_body=True)][6] == history[:14]
    found = store.find_deepest_prefix_version(
        ALICE, "long", [*history[:20], {"role": "user", "content": "x"}]
    )
    assert found is not None and found.number == 10 and found.messages == history[:20]


def test_other_users_see_nothing(store: VersionStore, session_factory: sessionmaker[Session]) -> None:
    store.create_session(ALICE, "private")
    store.commit(ALICE, "private", tokens=[1, 2], messages=turns("hi"))
    calls: list[Callable[[], object]] = [
        lambda: store.get_session(BOB, "private"),
        lambda: store.list_branches(BOB, "private"),
        lambda: store.get_branch(BOB, "private", "main"),
        lambda: store.list_versions(BOB, "private"),
        lambda: store.get_version(BOB, "private", 1),
        lambda: store.ancestors(BOB, "private", 1),
        lambda: store.commit(BOB, "private", tokens=[3], messages=[]),
        lambda: store.rollback(BOB, "private", "main", 1),
        lambda: store.branch(BOB, "private", 1, "mine"),
        lambda: store.find_deepest_prefix_version(BOB, "private", turns("hi")),
        lambda: store.delete_session(BOB, "private"),
    ]
    for call in calls:
        with pytest.raises(SessionNotFound) as err:
            call()
        # Same message as for an id that does not exist at all.
        with pytest.raises(SessionNotFound) as missing:
            store.get_session(BOB, "absent")
        assert str(err.value).replace("private", "X") == str(missing.value).replace("absent", "X")
    assert store.list_sessions(BOB) == ([], False)
    assert count_user_rows(session_factory, BOB) == {
        "sessions": 0,
        "versions": 0,
        "branches": 0,
        "responses": 0,
    }
    assert store.get_session(ALICE, "private").version_count == 1
    assert heads(store, ALICE, "private") == {"main": 1}


def test_list_sessions_pages_in_creation_order(store: VersionStore) -> None:
    made = [store.create_session(ALICE, f"s{i}").id for i in range(5)]
    store.create_session(BOB, "b0")
    page1, more1 = store.list_sessions(ALICE, limit=2)
    page2, more2 = store.list_sessions(ALICE, limit=2, after=page1[-1].id)
    page3, more3 = store.list_sessions(ALICE, limit=2, after=page2[-1].id)
    assert [s.id for s in page1 + page2 + page3] == made
    assert (more1, more2, more3) == (True, True, False)
    assert all(len(s.branches) == 1 for s in page1)
    with pytest.raises(InvalidInput):
        store.list_sessions(ALICE, limit=0)
    with pytest.raises(InvalidInput):
        store.list_sessions(ALICE, after="b0")  # Bob's session is no cursor for Alice


def test_delete_session_and_user_erasure(store: VersionStore, session_factory: sessionmaker[Session]) -> None:
    for sid in ("a1", "a2"):
        store.create_session(ALICE, sid)
        store.commit(ALICE, sid, tokens=[1], messages=[])
        store.commit(ALICE, sid, tokens=[1, 2], messages=[])
    store.branch(ALICE, "a2", 1, "side")
    store.create_session(BOB, "b1")
    store.commit(BOB, "b1", tokens=[5], messages=[])

    assert store.delete_session(ALICE, "a1") == 2
    with pytest.raises(SessionNotFound):
        store.get_session(ALICE, "a1")
    assert count_user_rows(session_factory, ALICE) == {
        "sessions": 1,
        "versions": 2,
        "branches": 2,
        "responses": 0,
    }
    assert user_ids_with_data(session_factory) == [ALICE, BOB]
    assert store.delete_user_sessions(ALICE) == {"sessions": 1, "versions": 2, "branches": 2, "responses": 0}
    assert count_user_rows(session_factory, ALICE) == {
        "sessions": 0,
        "versions": 0,
        "branches": 0,
        "responses": 0,
    }
    assert count_user_rows(session_factory, BOB) == {
        "sessions": 1,
        "versions": 1,
        "branches": 1,
        "responses": 0,
    }
    assert user_ids_with_data(session_factory) == [BOB]
    assert store.check() == []


def test_delete_user_sessions_joins_the_callers_transaction(
    store: VersionStore, session_factory: sessionmaker[Session]
) -> None:
    store.create_session(ALICE, "a")
    store.commit(ALICE, "a", tokens=[1], messages=[])
    with pytest.raises(RuntimeError), session_factory() as db, db.begin():
        assert store.delete_user_sessions(ALICE, db) == {
            "sessions": 1,
            "versions": 1,
            "branches": 1,
            "responses": 0,
        }
        assert count_user_rows(session_factory, ALICE, db)["sessions"] == 0
        raise RuntimeError("erasure failed later")
    assert count_user_rows(session_factory, ALICE) == {
        "sessions": 1,
        "versions": 1,
        "branches": 1,
        "responses": 0,
    }


def _race(n: int, work: Callable[[int], T]) -> list[T | Exception]:
    """Run `work(i)` in n threads released together; each slot holds a result or an exception."""
    barrier = threading.Barrier(n)
    results: list[T | Exception] = [RuntimeError("thread did not finish")] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = work(i)
        except Exception as exc:  # collected and asserted on below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results


def test_concurrent_commits_on_one_head_exactly_one_wins(store: VersionStore) -> None:
    store.create_session(ALICE, "race")
    n, rounds = 6, 3
    for r in range(rounds):
        head = store.get_branch(ALICE, "race", "main").head_version

        def attempt(i: int, head: int = head) -> VersionInfo:
            return store.commit(ALICE, "race", tokens=[i], messages=[], expected_head=head)

        results = _race(n, attempt)
        wins = [x for x in results if isinstance(x, VersionInfo)]
        assert len(wins) == 1, results
        assert all(isinstance(x, StaleHead) for x in results if x is not wins[0]), results
        assert (wins[0].number, wins[0].parent) == (r + 1, head or None)
    assert [v.number for v in store.list_versions(ALICE, "race")] == [1, 2, 3]
    assert store.get_session(ALICE, "race").version_count == rounds
    assert store.check() == []


def test_concurrent_commits_without_expected_head_all_land_in_one_chain(store: VersionStore) -> None:
    store.create_session(ALICE, "pile")
    n, each = 4, 3
    results = _race(
        n, lambda i: [store.commit(ALICE, "pile", tokens=[i, k], messages=[]).number for k in range(each)]
    )
    numbers = sorted(num for x in results if not isinstance(x, Exception) for num in x)
    assert not any(isinstance(x, Exception) for x in results), results
    assert numbers == list(range(1, n * each + 1))  # no gaps, no duplicates
    head = store.get_branch(ALICE, "pile", "main").head_version
    assert head == n * each
    assert sorted(store.ancestors(ALICE, "pile", head)) == numbers  # one linear history
    assert store.check() == []


def test_concurrent_ensure_session_creates_once(
    store: VersionStore, session_factory: sessionmaker[Session]
) -> None:
    results = _race(5, lambda i: store.ensure_session(ALICE, "shared"))
    created = [x[1] for x in results if not isinstance(x, Exception)]
    assert len(created) == 5 and created.count(True) == 1, results
    assert count_user_rows(session_factory, ALICE) == {
        "sessions": 1,
        "versions": 0,
        "branches": 1,
        "responses": 0,
    }


def test_limits(store: VersionStore) -> None:
    store.create_session(ALICE, "big")
    at_limit = store.commit(ALICE, "big", tokens=np.arange(MAX_TOKENS, dtype=np.int32), messages=[])
    assert at_limit.n_tokens == MAX_TOKENS
    assert store.get_version(ALICE, "big", 1).tokens[-1] == MAX_TOKENS - 1
    with pytest.raises(LimitExceeded):
        store.commit(ALICE, "big", tokens=np.zeros(MAX_TOKENS + 1, dtype=np.int32), messages=[])
    with pytest.raises(LimitExceeded):
        store.commit(ALICE, "big", tokens=[1], messages=[msg("user", "x" * (8 << 20))])
    with pytest.raises(InvalidInput):
        store.commit(ALICE, "big", tokens=[[1, 2]], messages=[])  # type: ignore[list-item]
    with pytest.raises(InvalidInput):
        store.commit(ALICE, "big", tokens=[-1], messages=[])
    with pytest.raises(InvalidInput):
        store.commit(ALICE, "big", tokens=[1.5], messages=[])  # type: ignore[list-item]
    with pytest.raises(InvalidInput):
        store.commit(ALICE, "big", tokens=[1 << 31], messages=[])
    with pytest.raises(InvalidInput):
        store.commit(ALICE, "big", tokens=[1], messages=["not a dict"])  # type: ignore[list-item]
    with pytest.raises(InvalidInput):
        store.commit(ALICE, "big", tokens=[1], messages=[{"content": object()}])
    assert store.get_session(ALICE, "big").version_count == 1
    empty = store.commit(ALICE, "big", tokens=[], messages=[])
    assert empty.n_tokens == 0 and store.get_version(ALICE, "big", 2).tokens.size == 0


def test_find_deepest_prefix_version_with_edited_history(store: VersionStore) -> None:
    store.create_session(ALICE, "chat")
    assert store.find_deepest_prefix_version(ALICE, "chat", turns("u1")) is None
    store.commit(ALICE, "chat", tokens=[1], messages=turns("u1", "a1"))  # 1
    store.commit(ALICE, "chat", tokens=[2], messages=turns("u1", "a1", "u2", "a2"))  # 2
    store.commit(ALICE, "chat", tokens=[3], messages=turns("u1", "a1", "u2", "a2", "u3", "a3"))  # 3

    def deepest(*contents: str) -> int | None:
        found = store.find_deepest_prefix_version(ALICE, "chat", turns(*contents))
        return None if found is None else found.number

    assert deepest("u1", "a1", "u2", "a2", "u3", "a3", "u4") == 3
    assert deepest("u1", "a1", "u2", "a2", "u3", "a3") == 3  # equal counts as a prefix
    assert deepest("u1", "a1", "u2", "a2", "u3") == 2
    assert deepest("u1", "a1", "u2-edited") == 1
    assert deepest("other") is None

    # The user edits turn 2: the API rolls back to 1 and commits the new history on main.
    store.rollback(ALICE, "chat", "main", 1)
    store.commit(ALICE, "chat", tokens=[4], messages=turns("u1", "a1", "u2-edited", "a2'"))  # 4
    assert deepest("u1", "a1", "u2-edited", "a2'", "u5") == 4
    assert deepest("u1", "a1", "u2", "a2", "u3") == 2  # the old history is still there

    # Same messages on another branch: both heads, so the lower number wins ...
    store.branch(ALICE, "chat", 1, "retry")
    store.commit(ALICE, "chat", tokens=[5], messages=turns("u1", "a1", "u2-edited", "a2'"), branch="retry")
    assert deepest("u1", "a1", "u2-edited", "a2'") == 4
    # ... until main moves away from 4: then the branch head beats the orphaned version.
    store.rollback(ALICE, "chat", "main", 1)
    found = store.find_deepest_prefix_version(ALICE, "chat", turns("u1", "a1", "u2-edited", "a2'", "u6"))
    assert found is not None and (found.number, found.branch) == (5, "retry")
    assert found.tokens.tolist() == [5]


@pytest.mark.parametrize("number", [10**20, -(10**20), (1 << 63), (1 << 40), (1 << 31), -1])
def test_numbers_no_column_can_hold_are_not_found(store: VersionStore, number: int) -> None:
    """`GET .../versions/99999999999999999999` answered 500: the number overflowed the driver; on
    PostgreSQL so did any number past the INTEGER column (2**31 and up: DataError)."""
    store.create_session(ALICE, "s")
    store.commit(ALICE, "s", tokens=[1], messages=[])
    with pytest.raises(VersionNotFound):
        store.get_version(ALICE, "s", number)
    with pytest.raises(VersionNotFound):
        store.get_version(ALICE, "s", number, with_body=False)
    with pytest.raises(VersionNotFound):
        store.branch(ALICE, "s", number, "b")
    with pytest.raises(VersionNotFound):
        store.rollback(ALICE, "s", "main", number)
    with pytest.raises(VersionNotFound):
        store.ancestors(ALICE, "s", number)


def test_token_ids_are_walked_in_chunks_and_versions_listed_in_pages(store: VersionStore) -> None:
    """`iter_tokens` (deleting a session, `stored_bytes`) reads token ids a few versions per
    transaction, never messages; `version_page` is the versions listing's cursor page."""
    for sid in ("a", "b"):
        store.create_session(ALICE, sid)
        for i in range(11):  # more than one chunk
            fp = "fp-x" if i % 2 else "fp-y"
            store.commit(ALICE, sid, tokens=[i + 1] * (i + 1), messages=turns(f"{sid}{i}"), fingerprint=fp)
    store.create_session(BOB, "a")
    store.commit(BOB, "a", tokens=[5], messages=turns("bob"), fingerprint="fp-x")
    store.commit(ALICE, "a", tokens=[], messages=turns("empty"), fingerprint="fp-x")  # no tokens: left out
    walked = [(v.session_id, v.number, v.fingerprint, v.tokens.tolist()) for v in store.iter_tokens(ALICE)]
    expected = [
        (sid, i + 1, "fp-x" if i % 2 else "fp-y", [i + 1] * (i + 1)) for sid in ("a", "b") for i in range(11)
    ]
    assert walked == expected
    assert [(v.session_id, v.number) for v in store.iter_tokens(ALICE, fingerprints=["fp-x"])] == [
        (sid, n) for sid in ("a", "b") for n in (2, 4, 6, 8, 10)
    ]
    assert list(store.iter_tokens(ALICE, fingerprints=[])) == []
    assert [v.number for v in store.iter_tokens(ALICE, "b", after=3, through=9)] == [4, 5, 6, 7, 8, 9]
    assert [v.tokens.tolist() for v in store.iter_tokens(BOB)] == [[5]]
    with pytest.raises(SessionNotFound):
        store.iter_tokens(BOB, "b")  # at the call, not at the first item
    pool = store_engine(store).pool
    before = pool.checkedout()  # type: ignore[attr-defined]
    unstarted, half = store.iter_tokens(ALICE, "b"), store.iter_tokens(ALICE)
    next(half)
    assert pool.checkedout() == before + 2  # type: ignore[attr-defined]  # "b" was checked already
    del unstarted, half  # dropped walks end their transactions and give their connections back
    assert pool.checkedout() == before  # type: ignore[attr-defined]

    page, more = store.version_page(ALICE, "a", limit=5)
    assert [v.number for v in page] == [1, 2, 3, 4, 5] and more
    page, more = store.version_page(ALICE, "a", limit=5, after=10)
    assert [v.number for v in page] == [11, 12] and not more
    store.delete_subtree(ALICE, "a", 12)
    assert store.version_page(ALICE, "a", limit=5, after=12) == ([], False)  # a gone cursor still pages
    assert [v.number for v in store.version_page(ALICE, "a", limit=5, after=10)[0]] == [11]
    assert store.version_page(ALICE, "a", limit=5, after=2**63 - 1) == ([], False)  # past INTEGER
    assert list(store.iter_tokens(ALICE, "a", after=2**63 - 1)) == []
    assert [v.number for v in store.iter_tokens(ALICE, "a", after=10, through=2**63 - 1)] == [11]
    with pytest.raises(InvalidInput):
        store.version_page(ALICE, "a", limit=0)
    with pytest.raises(SessionNotFound):
        store.version_page(BOB, "b")


def test_every_method_is_declared_and_internal_calls_go_through_the_instance(
    store: VersionStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`VersionStore` declares its methods: each public name is a function on the class (on the
    piece that owns it, exactly one), none is an instance attribute; and a call one method makes
    to another goes through the instance, so patching the instance catches it."""
    import inspect

    from dss.dialogue.versions.branches import Branches
    from dss.dialogue.versions.reads import VersionReads
    from dss.dialogue.versions.sessions import SessionCatalog
    from dss.dialogue.versions.shared import VersionTables
    from dss.dialogue.versions.writes import VersionWrites

    assert not [n for n, v in vars(store).items() if inspect.ismethod(v)]  # nothing bound per instance
    pieces = (SessionCatalog, VersionWrites, Branches, VersionReads, VersionTables, VersionStore)
    public = {n for n in dir(store) if not n.startswith("_")}
    for name in public:
        owners = [p for p in pieces if name in vars(p)]
        assert len(owners) == 1, f"{name}: {owners}"
        assert inspect.isfunction(inspect.getattr_static(store, name)), name
    store.create_session(ALICE, "held")
    seen: list[str] = []
    real = store.get_session
    monkeypatch.setattr(store, "get_session", lambda *a, **k: seen.append("get") or real(*a, **k))
    store.ensure_session(ALICE, "held")
    assert seen == ["get"]
