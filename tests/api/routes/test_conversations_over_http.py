"""The OpenAI Conversations API on DSS sessions, through the official `openai` client against the
real server: the conversation and its items (create, retrieve, update, delete; items added, listed
page by page, read, deleted as a new version), responses in a conversation (`conversation` in
`POST /v1/responses`) whose later turns are served from the stored KV, the 400 for `conversation`
with `previous_response_id`, another user's conversation as a 404, and the erasure of the user.
A conversation across a restart is in tests/api/test_restart.py (one restart of the shared server
for every API: `conversation_before` / `conversation_after` here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import openai
import pytest

from dss.db.connect import make_engine, make_session_factory, sqlite_url_for
from tests.api.routes.test_responses import INSTRUCTIONS, dss
from tests.api_server import ApiServer, api_server
from tests.db_helpers import count_user_rows

pytestmark = [pytest.mark.engine]
__all__ = ["api_server"]


def say(client: Any, conversation: str, text: str, **extra: Any) -> Any:
    return client.responses.create(
        model="default",
        input=text,
        instructions=INSTRUCTIONS,
        conversation=conversation,
        max_output_tokens=6,
        temperature=0,
        **extra,
    )


def texts(client: Any, conversation: str) -> list[tuple[str, str, str]]:
    """Every item, oldest first, as (id, role, text), read page by page (two items a page)."""
    page = client.conversations.items.list(conversation, order="asc", limit=2)
    return [(i.id, i.role, i.content[0].text) for i in page]  # every page, `after` the last id


def test_a_conversation_and_its_items(api_server: ApiServer) -> None:
    c = api_server.openai("conv-al")
    conv = c.conversations.create(
        items=[{"type": "message", "role": "user", "content": "Remember the number 7."}],
        metadata={"topic": "numbers"},
    )
    assert conv.id.startswith("conv_") and conv.object == "conversation"
    assert conv.metadata == {"topic": "numbers"}
    got = c.conversations.retrieve(conv.id)
    assert (got.id, got.created_at, got.metadata) == (conv.id, conv.created_at, conv.metadata)
    assert c.conversations.update(conv.id, metadata={"topic": "sevens"}).metadata == {"topic": "sevens"}
    added = c.conversations.items.create(
        conv.id,
        items=[
            {"type": "message", "role": "assistant", "content": "Noted."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And 9."}]},
        ],
    )
    assert [i.role for i in added.data] == ["assistant", "user"]
    listed = texts(c, conv.id)
    assert [(r, t) for _, r, t in listed] == [
        ("user", "Remember the number 7."), ("assistant", "Noted."), ("user", "And 9."),
    ]  # fmt: skip
    assert listed == texts(c, conv.id)  # item ids are stable across reads
    newest = c.conversations.items.list(conv.id, limit=1)  # OpenAI's default order: newest first
    assert [i.id for i in newest.data] == [listed[-1][0]] and newest.has_more
    one = c.conversations.items.retrieve(listed[1][0], conversation_id=conv.id)
    assert one.type == "message" and one.content[0].type == "output_text" and one.content[0].text == "Noted."
    # Deleting an item answers the conversation; it is a new version without the item.
    after = c.conversations.items.delete(listed[1][0], conversation_id=conv.id)
    assert after.id == conv.id
    assert texts(c, conv.id) == [listed[0], listed[2]]
    h = api_server.client("conv-al")
    versions = h.get(f"/v1/sessions/{conv.id}/versions").json()["data"]
    assert [v["number"] for v in versions] == [1, 2, 3]  # seeded, items added, item deleted
    with pytest.raises(openai.NotFoundError):
        c.conversations.items.retrieve(listed[1][0], conversation_id=conv.id)
    gone = c.conversations.delete(conv.id)
    assert gone.deleted and gone.id == conv.id
    with pytest.raises(openai.NotFoundError):
        c.conversations.retrieve(conv.id)


def test_responses_in_a_conversation_continue_from_the_stored_kv(api_server: ApiServer) -> None:
    c = api_server.openai("conv-bo")
    conv = c.conversations.create()
    r1 = say(c, conv.id, "Which station is the oldest?")
    assert r1.conversation is not None and r1.conversation.id == conv.id
    r2 = say(c, conv.id, "And the newest?")
    # The second turn continues from the first one's stored token ids: its whole prompt but the
    # first answer's last token (generated, never fed back) is served from the cache.
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.total_tokens - 1, r2.usage
    assert dss(r2)["session_id"] == conv.id and dss(r2)["branch"] == "main"
    # The items: each response's input and output, under the ids the responses gave them.
    items = texts(c, conv.id)
    assert [r for _, r, _ in items] == ["user", "assistant", "user", "assistant"]
    assert items[1] == (r1.output[0].id, "assistant", r1.output_text)
    assert items[3] == (r2.output[0].id, "assistant", r2.output_text)
    # Items added between turns are a version of messages only: the next turn still continues
    # from the last response's stored ids.
    c.conversations.items.create(conv.id, items=[{"type": "message", "role": "user", "content": "Thanks."}])
    r3 = say(c, conv.id, "One more question: which opened in 1883?")
    assert r3.usage.input_tokens_details.cached_tokens >= r2.usage.total_tokens - 1, r3.usage
    assert len(texts(c, conv.id)) == 7
    # `conversation` with `previous_response_id`: 400, as OpenAI answers; with store false too.
    with pytest.raises(openai.BadRequestError) as err:
        say(c, conv.id, "x", previous_response_id=r1.id)
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "mutually_exclusive_parameters"
    with pytest.raises(openai.BadRequestError):
        say(c, conv.id, "x", store=False)
    assert len(texts(c, conv.id)) == 7  # nothing refused was added
    # Another user's conversation is a 404, exactly like a missing one.
    eve = api_server.openai("conv-eve")
    for call in (
        lambda: eve.conversations.retrieve(conv.id),
        lambda: eve.conversations.items.list(conv.id),
        lambda: eve.conversations.items.create(conv.id, items=[{"role": "user", "content": "hi"}]),
        lambda: eve.conversations.delete(conv.id),
        lambda: say(eve, conv.id, "hi"),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert isinstance(missing.value.body, dict)
        assert missing.value.body["code"] == "conversation_not_found", missing.value.body
    assert len(texts(c, conv.id)) == 7


def test_a_conversation_is_erased_with_its_user(api_server: ApiServer) -> None:
    c = api_server.openai("conv-cy")
    conv = c.conversations.create(items=[{"role": "user", "content": "My locker code is 4711."}])
    say(c, conv.id, "Which station is the oldest?")
    admin = api_server.client("admin", admin=True)
    receipt = admin.delete("/v1/users/conv-cy")
    assert receipt.status_code == 200, receipt.text
    assert receipt.json()["counts"]["responses"] == 1 and receipt.json()["verification"]["remnants"] == 0
    with pytest.raises(openai.NotFoundError):
        c.conversations.retrieve(conv.id)
    engine = make_engine(sqlite_url_for(api_server.data_dir))
    try:
        rows = count_user_rows(make_session_factory(engine), "conv-cy")
    finally:
        engine.dispose()
    assert rows == {"sessions": 0, "versions": 0, "branches": 0, "responses": 0}


# ------------------------------------------------------- across a restart (tests/api/test_restart.py)
@dataclass
class Before:
    conversation: str
    items: list[tuple[str, str, str]]
    last: Any  # the last response


def conversation_before(c: Any) -> Before:
    conv = c.conversations.create(metadata={"kept": "yes"})
    say(c, conv.id, "Which station is the oldest?")
    last = say(c, conv.id, "And the newest?")
    return Before(conv.id, texts(c, conv.id), last)


def conversation_after(c: Any, before: Before) -> None:
    assert c.conversations.retrieve(before.conversation).metadata == {"kept": "yes"}
    assert texts(c, before.conversation) == before.items
    nxt = say(c, before.conversation, "Thank you.")
    cached = nxt.usage.input_tokens_details.cached_tokens
    assert cached >= before.last.usage.total_tokens - 1, nxt.usage
    assert dss(nxt)["loaded_tokens"] > 0, dss(nxt)  # from the store: the engine's cache was new
    assert len(texts(c, before.conversation)) == len(before.items) + 2
