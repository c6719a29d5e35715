"""Stored Responses API responses on SQLite and PostgreSQL: records, chains, forks, DELETE with and
without cascade, session deletion, erasure, durability, the version subtree they stand on, and
migration 0005."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text, update
from sqlalchemy.orm import Session, sessionmaker

from dss.db.connect import current_revision, make_engine, make_session_factory, transaction, upgrade_to_head
from dss.db.models import Base, ResponseRow
from dss.dialogue.response_store import (
    Deleted,
    Descendants,
    ResponseRecord,
    ResponseStore,
    new_response_id,
)
from dss.dialogue.versions import VersionStore
from dss.errors import (
    ConflictError,
    InvalidInput,
    NotFoundError,
    ResponseExists,
    ResponseHasDescendants,
    ResponseNotFound,
    SessionNotFound,
    VersionNotFound,
)
from dss.store import Store
from tests.db_helpers import HEAD_REVISION, count_user_rows
from tests.store_helpers import open_store, seed_one_version

ALICE = "alice"
BOB = "bob"


class Stores:
    """A version store and a response store over one database, with a builder of turns."""

    def __init__(self, sf: sessionmaker[Session]) -> None:
        self.sf = sf
        self.versions = VersionStore(sf)
        self.responses = ResponseStore(sf, self.versions)

    def check(self) -> None:
        assert self.versions.check() == []
        assert self.responses.check() == []


@pytest.fixture
def st(session_factory: sessionmaker[Session]) -> Iterator[Stores]:
    stores = Stores(session_factory)
    yield stores
    stores.check()  # every test ends healthy


def record(
    user: str, sid: str, version: int, prev: ResponseRecord | None, text_: str, **changes: Any
) -> ResponseRecord:
    rec = ResponseRecord(
        id=new_response_id(),
        user=user,
        session_id=sid,
        version=version,
        previous_response_id=prev.id if prev is not None else None,
        created_at=datetime.now(UTC),
        model="tiny-test",
        status="completed",
        instructions="be brief" if prev is None else None,
        input_items=[{"type": "message", "role": "user", "content": text_}],
        output=[
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": f"re: {text_}", "annotations": []}],
            }
        ],
        usage={"input_tokens": 4, "output_tokens": 2, "input_tokens_details": {"cached_tokens": 0}},
        params={"temperature": 0.0, "top_p": 1.0, "max_output_tokens": 8, "metadata": {"k": "v"}},
    )
    return replace(rec, **changes)


def respond(
    s: Stores | Store, user: str, sid: str, prev: ResponseRecord | None, text_: str
) -> ResponseRecord:
    """One turn as the route makes it: a version committed on top of `prev`'s (on a branch whose
    head it is, a new branch when none is: a fork), then the record of it."""
    parent = prev.version if prev is not None else 0
    heads = {b.name: b.head_version for b in s.versions.list_branches(user, sid)}
    branch = next((name for name, head in heads.items() if head == parent), None)
    if branch is None:
        branch = f"fork-{len(heads)}"
        s.versions.branch(user, sid, parent, branch)
    v = s.versions.commit(
        user,
        sid,
        tokens=[*range(1, 4 * (parent + 1) + 1)],
        messages=[{"role": "user", "content": text_}],
        branch=branch,
        expected_head=parent,
    )
    rec = record(user, sid, v.number, prev, text_)
    s.responses.add(rec)
    return rec


def heads(s: Stores | Store, user: str, sid: str) -> dict[str, int]:
    return {b.name: b.head_version for b in s.versions.list_branches(user, sid)}


def numbers(s: Stores | Store, user: str, sid: str) -> list[int]:
    return [v.number for v in s.versions.list_versions(user, sid)]


# --- records and chains ---------------------------------------------------------------------------
def test_add_get_chain_round_trip(st: Stores) -> None:
    st.versions.create_session(ALICE, "chat")
    r1 = respond(st, ALICE, "chat", None, "hello")
    r2 = respond(st, ALICE, "chat", r1, "and then?")
    r3 = respond(st, ALICE, "chat", r2, "thanks")
    assert len(r1.id) == 53 and r1.id.startswith("resp_") and r1.id != r2.id
    got = st.responses.get(ALICE, r2.id)
    assert got == r2  # every field, the JSON ones included, comes back as given
    assert got.created_at.tzinfo is not None and got.created_at.utcoffset() == timedelta(0)
    assert (got.session_id, got.version, got.previous_response_id) == ("chat", 2, r1.id)
    assert st.responses.chain(ALICE, r3.id) == [r1, r2, r3]
    assert st.responses.chain(ALICE, r1.id) == [r1]
    assert st.responses.descendants(ALICE, r1.id) == Descendants([r2.id, r3.id], [2, 3], [])
    assert st.responses.descendants(ALICE, r3.id).empty
    assert count_user_rows(st.sf, ALICE)["responses"] == 3


def test_other_users_and_unknown_ids_get_response_not_found(st: Stores) -> None:
    st.versions.create_session(ALICE, "chat")
    r1 = respond(st, ALICE, "chat", None, "secret")
    unknown = new_response_id()
    for rid in (r1.id, unknown, "resp_nothex", "x" * 5000):
        for call in (
            lambda rid=rid: st.responses.get(BOB, rid),
            lambda rid=rid: st.responses.chain(BOB, rid),
            lambda rid=rid: st.responses.descendants(BOB, rid),
            lambda rid=rid: st.responses.delete(BOB, rid, cascade=True),
        ):
            with pytest.raises(ResponseNotFound) as err:
                call()
            assert isinstance(err.value, NotFoundError)
            assert str(err.value) == f"response {rid!r} not found"  # says nothing about alice's
    # Bob cannot hang a record on Alice's version, nor continue Alice's response from his session.
    with pytest.raises(VersionNotFound):
        st.responses.add(record(BOB, "chat", r1.version, None, "mine?"))
    st.versions.create_session(BOB, "chat")
    v = st.versions.commit(BOB, "chat", tokens=[1], messages=[])
    with pytest.raises(ResponseNotFound):
        st.responses.add(record(BOB, "chat", v.number, r1, "continue hers"))
    assert st.responses.get(ALICE, r1.id) == r1
    assert count_user_rows(st.sf, BOB)["responses"] == 0


def test_add_refuses_bad_records(st: Stores) -> None:
    st.versions.create_session(ALICE, "a")
    st.versions.create_session(ALICE, "b")
    r1 = respond(st, ALICE, "a", None, "one")
    r2 = respond(st, ALICE, "a", r1, "two")
    with pytest.raises(ResponseExists) as dup:
        st.responses.add(replace(r2, version=r1.version, previous_response_id=None))
    assert isinstance(dup.value, ConflictError)
    with pytest.raises(VersionNotFound):
        st.responses.add(record(ALICE, "a", 99, None, "no such version"))
    with pytest.raises(VersionNotFound):
        st.responses.add(record(ALICE, "nope", 1, None, "no such session"))
    vb = st.versions.commit(ALICE, "b", tokens=[1], messages=[])
    with pytest.raises(InvalidInput, match="another session"):
        st.responses.add(record(ALICE, "b", vb.number, r1, "across sessions"))
    # A previous response must be an ancestor of the new version: r2's version is not r1's parent.
    st.versions.branch(ALICE, "a", 0, "fresh")
    v_root = st.versions.commit(ALICE, "a", tokens=[9], messages=[], branch="fresh")
    with pytest.raises(InvalidInput, match="does not continue"):
        st.responses.add(record(ALICE, "a", v_root.number, r2, "not on top of r2"))
    with pytest.raises(InvalidInput, match="does not continue"):
        st.responses.add(record(ALICE, "a", r2.version, r2, "itself"))  # own version: not strict
    bad: list[dict[str, Any]] = [
        {"id": "resp_123"},
        {"id": "chatcmpl-" + "0" * 48},
        {"created_at": datetime.now()},  # naive
        {"status": "great"},
        {"model": ""},
        {"params": {"x": object()}},
        {"params": {"x": float("nan")}},
        {"output": [["not", "a", "dict"]]},
        {"usage": []},
    ]
    for change in bad:
        with pytest.raises(InvalidInput):
            st.responses.add(record(ALICE, "a", v_root.number, None, "bad", **change))
    assert count_user_rows(st.sf, ALICE)["responses"] == 2


# --- DELETE -------------------------------------------------------------------------------------
def test_delete_a_leaf_deletes_its_record_and_its_version(st: Stores) -> None:
    st.versions.create_session(ALICE, "chat")
    r1 = respond(st, ALICE, "chat", None, "one")
    r2 = respond(st, ALICE, "chat", r1, "two")
    assert heads(st, ALICE, "chat") == {"main": 2}
    assert st.responses.delete(ALICE, r2.id) == Deleted(response_ids=[r2.id], versions=[2])
    with pytest.raises(ResponseNotFound):
        st.responses.get(ALICE, r2.id)
    with pytest.raises(VersionNotFound):
        st.versions.get_version(ALICE, "chat", 2)
    assert heads(st, ALICE, "chat") == {"main": 1}  # the head moved back to the parent
    assert st.responses.get(ALICE, r1.id) == r1 and st.responses.descendants(ALICE, r1.id).empty
    st.check()
    r2b = respond(st, ALICE, "chat", r1, "two again")
    assert r2b.version == 3  # numbers are never reused: 2 named the deleted version
    assert numbers(st, ALICE, "chat") == [1, 3]
    assert st.responses.chain(ALICE, r2b.id) == [r1, r2b]


def test_delete_with_descendants_is_refused_then_cascades(st: Stores) -> None:
    st.versions.create_session(ALICE, "chat")
    r1 = respond(st, ALICE, "chat", None, "one")
    r2 = respond(st, ALICE, "chat", r1, "two")
    r3 = respond(st, ALICE, "chat", r2, "three")
    r4 = respond(st, ALICE, "chat", r3, "four")
    r3b = respond(st, ALICE, "chat", r2, "three, otherwise")  # a fork from turn 2
    # A version committed on top of r4 through the session API, and a branch pointing at r3.
    st.versions.commit(ALICE, "chat", tokens=[1, 2], messages=[{"role": "user", "content": "direct"}])
    st.versions.branch(ALICE, "chat", r3.version, "bookmark")
    assert heads(st, ALICE, "chat") == {"main": 6, "fork-1": 5, "bookmark": 3}
    before = count_user_rows(st.sf, ALICE)

    with pytest.raises(ResponseHasDescendants) as err:
        st.responses.delete(ALICE, r2.id)
    assert isinstance(err.value, ConflictError)
    assert err.value.response_ids == [r3.id, r4.id, r3b.id]  # by version
    assert err.value.versions == [3, 4, 5, 6]
    for rid in (r3.id, r4.id, r3b.id):
        assert rid in str(err.value)
    assert "1 other version(s)" in str(err.value) and "cascade" in str(err.value)
    assert count_user_rows(st.sf, ALICE) == before  # nothing was deleted
    assert st.responses.descendants(ALICE, r2.id) == Descendants([r3.id, r4.id, r3b.id], [3, 4, 5, 6], [6])
    st.check()

    deleted = st.responses.delete(ALICE, r2.id, cascade=True)
    assert deleted == Deleted(response_ids=[r2.id, r3.id, r4.id, r3b.id], versions=[2, 3, 4, 5, 6])
    for rid in deleted.response_ids:
        with pytest.raises(ResponseNotFound):
            st.responses.get(ALICE, rid)
    assert numbers(st, ALICE, "chat") == [1]
    # Every head in the subtree moved to its root's parent; no branch was deleted.
    assert heads(st, ALICE, "chat") == {"main": 1, "fork-1": 1, "bookmark": 1}
    assert st.responses.chain(ALICE, r1.id) == [r1] and st.responses.descendants(ALICE, r1.id).empty
    assert count_user_rows(st.sf, ALICE)["responses"] == 1


def test_a_fork_survives_deleting_the_other_branch(st: Stores) -> None:
    st.versions.create_session(ALICE, "chat")
    r1 = respond(st, ALICE, "chat", None, "one")
    r2a = respond(st, ALICE, "chat", r1, "two")
    r2b = respond(st, ALICE, "chat", r1, "two, otherwise")  # same previous_response_id: a fork
    r3b = respond(st, ALICE, "chat", r2b, "three")
    assert r2a.previous_response_id == r2b.previous_response_id == r1.id
    assert heads(st, ALICE, "chat") == {"main": 2, "fork-1": 4}

    assert st.responses.delete(ALICE, r2a.id) == Deleted([r2a.id], [2])  # a leaf: no cascade needed
    assert st.responses.chain(ALICE, r3b.id) == [r1, r2b, r3b]
    assert heads(st, ALICE, "chat") == {"main": 1, "fork-1": 4}
    assert st.responses.descendants(ALICE, r1.id) == Descendants([r2b.id, r3b.id], [3, 4], [])
    st.check()

    assert st.responses.delete(ALICE, r2b.id, cascade=True) == Deleted([r2b.id, r3b.id], [3, 4])
    assert heads(st, ALICE, "chat") == {"main": 1, "fork-1": 1}
    assert st.responses.get(ALICE, r1.id) == r1
    assert numbers(st, ALICE, "chat") == [1]


def test_deleting_the_root_empties_the_session_but_keeps_it(st: Stores) -> None:
    st.versions.create_session(ALICE, "chat")
    r1 = respond(st, ALICE, "chat", None, "one")
    r2 = respond(st, ALICE, "chat", r1, "two")
    with pytest.raises(ResponseHasDescendants) as err:
        st.responses.delete(ALICE, r1.id)
    assert err.value.response_ids == [r2.id] and err.value.versions == [2]
    assert st.responses.delete(ALICE, r1.id, cascade=True) == Deleted([r1.id, r2.id], [1, 2])
    info = st.versions.get_session(ALICE, "chat")
    assert [(b.name, b.head_version) for b in info.branches] == [("main", 0)]
    assert numbers(st, ALICE, "chat") == [] and info.version_count == 2
    r1b = respond(st, ALICE, "chat", None, "start over")
    assert r1b.version == 3 and st.responses.chain(ALICE, r1b.id) == [r1b]


def test_a_version_committed_on_top_also_blocks_a_plain_delete(st: Stores) -> None:
    st.versions.create_session(ALICE, "chat")
    r1 = respond(st, ALICE, "chat", None, "one")
    st.versions.commit(ALICE, "chat", tokens=[5], messages=[])  # through the session API
    with pytest.raises(ResponseHasDescendants) as err:
        st.responses.delete(ALICE, r1.id)
    assert err.value.response_ids == [] and err.value.versions == [2]
    assert "1 other version(s)" in str(err.value)
    assert st.responses.delete(ALICE, r1.id, cascade=True) == Deleted([r1.id], [1, 2])


# --- the version subtree --------------------------------------------------------------------------
def test_delete_subtree_moves_heads_and_leaves_gaps(st: Stores) -> None:
    vs = st.versions
    vs.create_session(ALICE, "s")
    for _ in range(3):
        vs.commit(ALICE, "s", tokens=[1], messages=[])  # 1 <- 2 <- 3
    vs.branch(ALICE, "s", 1, "side")
    vs.commit(ALICE, "s", tokens=[2], messages=[], branch="side")  # 4, child of 1
    vs.branch(ALICE, "s", 2, "at2")
    assert vs.subtree(ALICE, "s", 2) == [2, 3] and vs.subtree(ALICE, "s", 1) == [1, 2, 3, 4]
    assert vs.lineage(ALICE, "s", 3) == [3, 2, 1]
    with pytest.raises(SessionNotFound):
        vs.delete_subtree(BOB, "s", 2)
    with pytest.raises(VersionNotFound):
        vs.delete_subtree(ALICE, "s", 9)
    with pytest.raises(VersionNotFound):
        vs.subtree(BOB, "s", 2)
    assert vs.delete_subtree(ALICE, "s", 2) == [2, 3]
    assert heads(st, ALICE, "s") == {"main": 1, "side": 4, "at2": 1}
    assert numbers(st, ALICE, "s") == [1, 4]
    assert vs.check() == []
    assert vs.commit(ALICE, "s", tokens=[3], messages=[]).number == 5
    assert vs.get_version(ALICE, "s", 5).parent == 1


def test_cascading_delete_and_concurrent_commits_stay_consistent(st: Stores) -> None:
    """A commit on a head inside the subtree either lands first (and is deleted with it) or
    retries on the moved head: never a version whose parent is gone."""
    for round_ in range(4):
        sid = f"race-{round_}"
        st.versions.create_session(ALICE, sid)
        r1 = respond(st, ALICE, sid, None, "one")
        r2 = respond(st, ALICE, sid, r1, "two")
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def commit(
            sid: str = sid, barrier: threading.Barrier = barrier, errors: list[BaseException] = errors
        ) -> None:
            barrier.wait()
            try:
                st.versions.commit(ALICE, sid, tokens=[7], messages=[])
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        t = threading.Thread(target=commit)
        t.start()
        barrier.wait()
        deleted = st.responses.delete(ALICE, r2.id, cascade=True)
        t.join(30)
        assert not t.is_alive() and errors == []
        left = numbers(st, ALICE, sid)
        assert left in ([1], [1, 3]), left  # the commit landed first (deleted) or after (on 1)
        assert deleted.versions == ([2, 3] if left == [1] else [2])
        st.check()


# --- sessions, erasure, durability ----------------------------------------------------------------
def test_deleting_a_session_deletes_its_responses(st: Stores) -> None:
    st.versions.create_session(ALICE, "gone")
    st.versions.create_session(ALICE, "kept")
    g1 = respond(st, ALICE, "gone", None, "one")
    g2 = respond(st, ALICE, "gone", g1, "two")
    k1 = respond(st, ALICE, "kept", None, "one")
    assert st.versions.delete_session(ALICE, "gone") == 2
    for rid in (g1.id, g2.id):
        with pytest.raises(ResponseNotFound):
            st.responses.get(ALICE, rid)
    assert st.responses.get(ALICE, k1.id) == k1
    assert count_user_rows(st.sf, ALICE) == {"sessions": 1, "versions": 1, "branches": 1, "responses": 1}
    assert st.versions.delete_user_sessions(ALICE) == {
        "sessions": 1,
        "versions": 1,
        "branches": 1,
        "responses": 1,
    }


def _store(tmp_path: Path, db_url: str) -> Store:
    return open_store(tmp_path / "data", db_url=db_url, shm_dir=tmp_path / "shm")


def test_the_store_deletes_a_session_with_its_responses(tmp_path: Path, db_url: str) -> None:
    store = _store(tmp_path, db_url)
    try:
        sid = store.versions.create_session(ALICE).id
        r1 = respond(store, ALICE, sid, None, "one")
        store.sessions.delete(ALICE, sid)
        with pytest.raises(ResponseNotFound):
            store.responses.get(ALICE, r1.id)
        assert store.responses.check() == [] and store.versions.check() == []
    finally:
        store.close()


def test_erasure_deletes_responses_and_verification_finds_none(tmp_path: Path, db_url: str) -> None:
    store = _store(tmp_path, db_url)
    try:
        sid = store.versions.create_session(ALICE, "chat").id
        r1 = respond(store, ALICE, sid, None, "one")
        r2 = respond(store, ALICE, sid, r1, "two")
        bob_sid = store.versions.create_session(BOB, "chat").id
        b1 = respond(store, BOB, bob_sid, None, "bob's")
        receipt = store.eraser.erase_user(ALICE)
        assert receipt.counts["responses"] == 2 and receipt.counts["versions"] == 2
        verification = store.eraser.verify(receipt.id)
        assert verification.remnants == 0 and verification.chain_ok, verification.details
        for rid in (r1.id, r2.id):
            with pytest.raises(ResponseNotFound):
                store.responses.get(ALICE, rid)
        assert count_user_rows(store.sf, ALICE)["responses"] == 0
        assert store.responses.get(BOB, b1.id) == b1  # others untouched

        # New data after the erasure is no remnant; a response row older than the erasure is one.
        store.versions.create_session(ALICE, "again")
        again = respond(store, ALICE, "again", None, "hello again")
        assert store.eraser.verify(receipt.id).remnants == 0
        with transaction(store.sf) as db:
            db.execute(
                update(ResponseRow)
                .where(ResponseRow.id == again.id)
                .values(created_at=receipt.erased_at - timedelta(hours=1))
            )
        planted = store.eraser.verify(receipt.id)
        assert planted.remnants == 1 and "1 stored response(s)" in planted.details[0], planted.details
        assert store.responses.check() == [] and store.versions.check() == []
    finally:
        store.close()


def test_responses_survive_reopening_the_store(tmp_path: Path, db_url: str) -> None:
    store = _store(tmp_path, db_url)
    try:
        sid = store.versions.create_session(ALICE, "chat").id
        r1 = respond(store, ALICE, sid, None, "one")
        r2 = respond(store, ALICE, sid, r1, "two")
        r2b = respond(store, ALICE, sid, r1, "two, otherwise")
    finally:
        store.close()
    store = _store(tmp_path, db_url)
    try:
        assert store.responses.chain(ALICE, r2.id) == [r1, r2]
        assert store.responses.chain(ALICE, r2b.id) == [r1, r2b]
        assert store.responses.get(ALICE, r2b.id) == r2b
        assert store.responses.descendants(ALICE, r1.id) == Descendants([r2.id, r2b.id], [2, 3], [])
        r3 = respond(store, ALICE, sid, r2b, "continue the fork after the restart")
        assert store.responses.chain(ALICE, r3.id) == [r1, r2b, r3]
        assert store.responses.check() == [] and store.versions.check() == []
    finally:
        store.close()


# --- invariants and migration ---------------------------------------------------------------------
def test_check_reports_broken_chains(st: Stores, session_factory: sessionmaker[Session]) -> None:
    st.versions.create_session(ALICE, "chat")
    r1 = respond(st, ALICE, "chat", None, "one")
    r2 = respond(st, ALICE, "chat", r1, "two")
    with transaction(session_factory) as db:
        db.execute(update(ResponseRow).where(ResponseRow.id == r2.id).values(previous_response_id=r2.id))
    assert st.responses.check() == [f"response {r2.id}: version 2 does not descend from 2 of {r2.id}"]
    ghost = new_response_id()
    with transaction(session_factory) as db:
        db.execute(update(ResponseRow).where(ResponseRow.id == r2.id).values(previous_response_id=ghost))
    assert st.responses.check() == [f"response {r2.id}: previous response {ghost} does not exist"]
    with transaction(session_factory) as db:
        db.execute(update(ResponseRow).where(ResponseRow.id == r2.id).values(previous_response_id=r1.id))
    assert st.responses.check() == []


def test_0005_upgrades_a_0004_database_with_data_in_it(db_url: str) -> None:
    from alembic import command

    from dss.db.connect import alembic_config

    command.upgrade(alembic_config(db_url), "0004")
    engine = make_engine(db_url)
    try:
        seed_one_version(engine)
        upgrade_to_head(db_url)
        assert current_revision(db_url) == HEAD_REVISION
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            assert list(compare_metadata(ctx, Base.metadata)) == []
        stores = Stores(make_session_factory(engine))
        stores.check()
        assert stores.versions.get_version("alice", "trip", 1).tokens.tolist() == [1, 2]
        r1 = record("alice", "trip", 1, None, "after the upgrade")
        stores.responses.add(r1)
        assert stores.responses.get("alice", r1.id) == r1
        stores.check()
        # The session's foreign key cascades too (for rows deleted outside the store).
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM sessions WHERE id = 'trip'"))
            assert conn.execute(text("SELECT count(*) FROM responses")).scalar_one() == 0
        command.downgrade(alembic_config(db_url), "0004")
        assert current_revision(db_url) == "0004"
    finally:
        engine.dispose()


def test_long_chains_and_subtrees_cross_the_in_list_chunks(
    st: Stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dss.dialogue.response_store as responses_module
    import dss.dialogue.versions.shared as versions_module

    monkeypatch.setattr(responses_module, "_IN_CHUNK", 2)
    monkeypatch.setattr(versions_module, "_IN_CHUNK", 2)
    st.versions.create_session(ALICE, "long")
    chain = [respond(st, ALICE, "long", None, "t0")]
    for i in range(1, 7):
        chain.append(respond(st, ALICE, "long", chain[-1], f"t{i}"))
    assert st.responses.chain(ALICE, chain[-1].id) == chain
    assert st.responses.descendants(ALICE, chain[1].id).response_ids == [r.id for r in chain[2:]]
    deleted = st.responses.delete(ALICE, chain[1].id, cascade=True)
    assert deleted == Deleted([r.id for r in chain[1:]], [2, 3, 4, 5, 6, 7])
    assert numbers(st, ALICE, "long") == [1] and heads(st, ALICE, "long") == {"main": 1}
