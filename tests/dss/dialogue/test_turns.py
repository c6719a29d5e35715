"""Committing a turn's choices and its Responses record: all or nothing, no empty sessions, no
version without its record (SQLite and PostgreSQL)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import numpy as np
import pytest
from sqlalchemy.orm import Session, sessionmaker

from dss.config import Quotas
from dss.dialogue.response_store import ResponseRecord, ResponseStore, new_response_id
from dss.dialogue.turns import (
    TurnTarget,
    add_response,
    commit_alternatives,
    commit_turn,
    response_dialogue,
    response_target,
)
from dss.dialogue.versions import MAIN_BRANCH, VersionStore
from dss.errors import QuotaExceeded, ResponseNotFound, SessionNotFound
from dss.types import SessionId

U = "ann"
Q = [{"role": "user", "content": "hi"}]


def toks(*ids: int) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


def answer(text: str) -> list[dict[str, str]]:
    return [*Q, {"role": "assistant", "content": text}]


def test_alternatives_commit_as_siblings_or_not_at_all(session_factory: sessionmaker[Session]) -> None:
    versions = VersionStore(session_factory, Quotas(max_versions=3))
    versions.create_session(U, "s")
    target = TurnTarget(SessionId("s"), None, MAIN_BRANCH, fork_on_race=False)
    two = commit_alternatives(
        versions, U, target, [(toks(1, 2), answer("a")), (toks(1, 3), answer("b"))], "fp"
    )
    assert [c.version.number for c in two] == [1, 2]
    assert two[0].branch == MAIN_BRANCH and two[1].branch != MAIN_BRANCH
    assert {c.version.parent for c in two} == {None}
    # One slot of the quota is left: a two-choice turn on top of version 1 must not half-land.
    on_one = TurnTarget(SessionId("s"), 1, MAIN_BRANCH, fork_on_race=True)
    with pytest.raises(QuotaExceeded):
        commit_alternatives(
            versions, U, on_one, [(toks(1, 2, 4), answer("c")), (toks(1, 2, 5), answer("d"))], "fp"
        )
    assert [v.number for v in versions.list_versions(U, "s")] == [1, 2]
    assert versions.get_branch(U, "s", MAIN_BRANCH).head_version == 1  # moved back
    assert versions.check() == []


def test_a_new_chain_creates_its_session_with_its_first_commit(
    session_factory: sessionmaker[Session],
) -> None:
    versions = VersionStore(session_factory)
    responses = ResponseStore(session_factory, versions)
    planned = response_target(versions, responses, U, None, "be brief", Q)
    assert planned.messages == [{"role": "system", "content": "be brief"}, *Q]
    sid = planned.target.session_id
    with pytest.raises(SessionNotFound):  # a turn that fails before its commit leaves nothing
        versions.get_session(U, sid)
    committed = commit_turn(versions, U, planned.target, toks(1, 2), [*planned.messages], "fp")
    assert committed.version.number == 1 and versions.get_session(U, sid).version_count == 1
    rec = _record(sid, 1, None, "be brief")
    add_response(versions, responses, rec)
    # The next turn, with other instructions: the previous ones are not carried over.
    messages, previous, base = response_dialogue(versions, responses, U, rec.id, "be long", Q)
    assert previous == responses.get(U, rec.id) and base is not None and base.number == 1
    assert messages == [{"role": "system", "content": "be long"}, *Q, *Q]


def test_a_version_whose_record_cannot_be_added_goes_again(session_factory: sessionmaker[Session]) -> None:
    versions = VersionStore(session_factory)
    responses = ResponseStore(session_factory, versions)
    versions.create_session(U, "r")
    target = TurnTarget(SessionId("r"), None, MAIN_BRANCH, fork_on_race=False)
    v = commit_turn(versions, U, target, toks(1, 2), answer("x"), "fp").version
    bad = replace(_record("r", v.number, None, None), previous_response_id="resp_" + "0" * 48)
    with pytest.raises(ResponseNotFound):
        add_response(versions, responses, bad)
    assert versions.list_versions(U, "r") == []  # no version is left without its record
    assert versions.get_branch(U, "r", MAIN_BRANCH).head_version == 0
    assert versions.check() == [] and responses.check() == []


def _record(sid: str, version: int, prev: str | None, instructions: str | None) -> ResponseRecord:
    return ResponseRecord(
        id=new_response_id(),
        user=U,
        session_id=sid,
        version=version,
        previous_response_id=prev,
        created_at=datetime.now(UTC),
        model="m",
        status="completed",
        instructions=instructions,
        input_items=[],
        output=[],
        usage={},
        params={},
    )
