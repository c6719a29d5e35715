"""Conversations on versioned sessions (`dss.dialogue.conversations`), on SQLite without an
engine: items as versions, stable item ids, deletion as a new version, instructions kept out of the
items, the version a response turn continues from, and another user's conversation reading as
missing. The HTTP API with the official client and a real engine is
tests/api/routes/test_conversations_over_http.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dss.db.connect import make_engine, make_session_factory, sqlite_url_for, upgrade_to_head
from dss.dialogue.conversations import INSTRUCTIONS_KEY, Conversations, dialogue_items
from dss.dialogue.versions import VersionStore
from dss.errors import (
    ConversationItemNotFound,
    ConversationNotFound,
    InvalidInput,
    LimitExceeded,
    StaleHead,
)
from dss.types import SessionId, UserId

ALICE = UserId("alice")
BOB = UserId("bob")


def item(item_id: str, text: str, role: str = "user") -> dict[str, object]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"id": item_id, "type": "message", "role": role, "content": [{"type": kind, "text": text}]}


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[tuple[VersionStore, Conversations]]:
    url = sqlite_url_for(tmp_path)
    upgrade_to_head(url)
    engine = make_engine(url)
    versions = VersionStore(make_session_factory(engine))
    yield versions, Conversations(versions)
    assert versions.check() == []
    engine.dispose()


def test_items_are_versions_with_stable_ids(stores: tuple[VersionStore, Conversations]) -> None:
    versions, convs = stores
    c = convs.create(ALICE, [item("msg_a", "hello"), item("msg_b", "hi", "assistant")], {"k": "v"})
    assert c.id.startswith("conv_") and c.metadata == {"k": "v"} and c.head == 1
    added = convs.append(ALICE, c.id, [item("msg_c", "more")])
    assert [i["id"] for i in added] == ["msg_c"]
    assert [i["id"] for i in convs.items(ALICE, c.id)] == ["msg_a", "msg_b", "msg_c"]
    assert convs.item(ALICE, c.id, "msg_b")["content"][0] == {
        "type": "output_text", "text": "hi", "annotations": [], "logprobs": [],
    }  # fmt: skip
    # Deleting an item is a new version without it; the version that held it stays.
    after = convs.delete_item(ALICE, c.id, "msg_b")
    assert after.head == 3
    assert [i["id"] for i in convs.items(ALICE, c.id)] == ["msg_a", "msg_c"]
    assert [m["content"] for m in versions.get_version(ALICE, c.id, 2).messages] == ["hello", "hi", "more"]
    with pytest.raises(ConversationItemNotFound):
        convs.item(ALICE, c.id, "msg_b")
    with pytest.raises(ConversationItemNotFound):
        convs.delete_item(ALICE, c.id, "msg_b")
    # Pages: newest first by default, `after` an item id.
    page = convs.page(ALICE, c.id, limit=1)
    assert [i["id"] for i in page.items] == ["msg_c"] and page.has_more
    page = convs.page(ALICE, c.id, limit=5, after="msg_c")
    assert [i["id"] for i in page.items] == ["msg_a"] and not page.has_more
    assert [i["id"] for i in convs.page(ALICE, c.id, limit=5, order="asc").items] == ["msg_a", "msg_c"]
    # Ids stay unique; metadata is replaced.
    with pytest.raises(InvalidInput):
        convs.append(ALICE, c.id, [item("msg_a", "again")])
    with pytest.raises(LimitExceeded):
        convs.append(ALICE, c.id, [item("msg_x", "x"), item("msg_y", "y")], max_items=3)
    assert convs.set_metadata(ALICE, c.id, {"k": "w"}).metadata == {"k": "w"}
    assert convs.get(ALICE, c.id).metadata == {"k": "w"}


def test_another_users_conversation_reads_as_missing(stores: tuple[VersionStore, Conversations]) -> None:
    _, convs = stores
    c = convs.create(ALICE, [item("msg_a", "secret")], None)
    for call in (
        lambda: convs.get(BOB, c.id),
        lambda: convs.items(BOB, c.id),
        lambda: convs.append(BOB, c.id, [item("msg_b", "x")]),
        lambda: convs.delete_item(BOB, c.id, "msg_a"),
        lambda: convs.set_metadata(BOB, c.id, {}),
        lambda: convs.get(ALICE, SessionId("conv_missing")),
    ):
        with pytest.raises(ConversationNotFound):
            call()


def test_a_turn_continues_from_the_deepest_version_holding_tokens(
    stores: tuple[VersionStore, Conversations],
) -> None:
    versions, convs = stores
    c = convs.create(ALICE, [], None)
    first = convs.turn(ALICE, c.id, "Be brief.", [{"role": "user", "content": "hi", "id": "msg_1"}])
    assert first.target.parent is None and first.target.branch == "main" and first.target.base is None
    assert first.messages[0] == {"role": "system", "content": "Be brief.", INSTRUCTIONS_KEY: True}
    answered = [*first.messages, {"role": "assistant", "content": "hello", "id": "msg_2"}]
    v1 = versions.commit(ALICE, c.id, tokens=[1, 2, 3], messages=answered, expected_head=0)
    # The instructions are not an item; added items are a version of messages only.
    assert [i["id"] for i in convs.items(ALICE, c.id)] == ["msg_1", "msg_2"]
    convs.append(ALICE, c.id, [item("msg_3", "note")])
    nxt = convs.turn(ALICE, c.id, "Be brief.", [{"role": "user", "content": "and?", "id": "msg_4"}])
    assert nxt.target.parent == 2 and nxt.target.base is not None and nxt.target.base.number == v1.number
    assert nxt.messages[: len(answered)] == answered
    # A change of instructions replaces them (the stored ones lead no more).
    other = convs.turn(ALICE, c.id, None, [{"role": "user", "content": "x", "id": "msg_5"}])
    assert other.messages[0]["id"] == "msg_1" and other.target.base is None
    # Racing the head: the commit is refused, never forked.
    convs.append(ALICE, c.id, [item("msg_6", "late")])
    with pytest.raises(StaleHead):
        versions.commit(ALICE, c.id, tokens=[1], messages=nxt.messages, expected_head=2)


def test_a_message_without_an_id_reads_with_a_stable_derived_one() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    ids = [i["id"] for i in dialogue_items(messages)]
    assert ids == [i["id"] for i in dialogue_items([dict(m) for m in messages])]
    assert all(i.startswith("msg_") for i in ids) and len(set(ids)) == 2


def test_a_response_s_instructions_leave_the_derived_ids_of_earlier_items_alone() -> None:
    # Messages stored through the sessions API carry no item id; a response in the conversation
    # then leads the dialogue with its instructions, which are not an item and must not move them.
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    before = [i["id"] for i in dialogue_items(messages)]
    for instructions in ("Be brief.", "Be thorough."):
        lead = {"role": "system", "content": instructions, INSTRUCTIONS_KEY: True}
        assert [i["id"] for i in dialogue_items([lead, *messages])] == before
