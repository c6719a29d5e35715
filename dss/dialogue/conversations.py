"""Conversations (OpenAI's Conversations API) on versioned sessions.

A conversation is a session. Its id is the session's id (`conv_` and 48 hex digits when
`Conversations.create` made it; any other session of the user reads as a conversation too), its
metadata is the session's metadata, and its items are the messages of the head version of its
`main` branch, oldest first. Nothing is kept beside the versions: a conversation is durable
across restarts, can be rolled back and branched like any session, and is erased with its user.

Invariants:
- Every change is a new version on `main`, committed on the head it was computed from (a
  concurrent change meanwhile: `StaleHead`, 409): adding items commits a child holding the head's
  messages and the new ones; deleting an item commits a child without it. No version is
  rewritten, so every earlier state of the conversation stays readable as a version.
- An item's id is stored in its message (`"id"`), so it reads the same on every read, after a
  restart and after other items are deleted. A message stored without one (committed through the
  sessions API) reads with an id derived from the digest of the messages up to and including it
  (`derived_item_id`): stable as long as those stay.
- Item ids are unique within a conversation: an added item whose id is already there (or twice in
  one request) is refused.
- A response's `instructions` lead its stored dialogue as a system message marked with
  `INSTRUCTIONS_KEY` (their token ids are in the version, so the next turn continues from them):
  they belong to that response, are not an item, and the next response puts its own instructions
  (or none) in their place, as in OpenAI's API.
- A response turn in a conversation (`Conversations.turn`) extends the head of `main` and commits
  there (never forking: a conversation is one line of items); its prompt continues from the
  stored token ids of the deepest version whose messages start its dialogue, so a version of
  added items (which holds messages only) does not cost the cache of the turn before it.
- Another user's conversation raises `ConversationNotFound`, exactly like a missing one.
- Every write takes `epoch`, the user's erasure epoch the request was admitted under, and passes
  it to the store's write fence: a write admitted before an erasure of its user that would
  commit after it writes nothing and raises `UserErased` (without it, a conversation created
  just before an erasure landed after it, under the re-created user).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from dss.dialogue.history import prefix_digests
from dss.dialogue.lead.policy import LeadPolicy, classify
from dss.dialogue.route_keys import checked_route_key, new_route_key
from dss.dialogue.turns import TurnTarget
from dss.dialogue.versions import EMPTY_HEAD, MAIN_BRANCH, SessionInfo, VersionStore
from dss.errors import (
    ConversationItemNotFound,
    ConversationNotFound,
    InvalidInput,
    LimitExceeded,
    SessionNotFound,
    UserErased,
)
from dss.types import SessionId, UserId

CONVERSATION_ID_PREFIX = "conv_"
# Marks the stored system message that holds a response's instructions (not an item).
INSTRUCTIONS_KEY = "dss_instructions"
# OpenAI's limit on the items one request may add.
MAX_ITEMS_PER_REQUEST = 20


def new_conversation_id(route_key: str | None = None) -> SessionId:
    """A fresh conversation (and session) id: `conv_`, the route key (`dss.dialogue.route_keys`; a
    random one when None), 32 random hex digits."""
    key = checked_route_key(route_key) or new_route_key()
    return SessionId(CONVERSATION_ID_PREFIX + key + secrets.token_hex(16))


def derived_item_id(digest: str) -> str:
    """The id of a stored message that has none: from the digest of the messages up to it."""
    return f"msg_{digest[:48]}"


@dataclass(frozen=True, slots=True)
class Conversation:
    id: SessionId
    created_at: datetime
    metadata: dict[str, Any]
    head: int  # the head version of `main`, whose messages are the items (EMPTY_HEAD: none yet)


@dataclass(frozen=True, slots=True)
class ItemPage:
    items: list[dict[str, Any]]
    has_more: bool


@dataclass(frozen=True, slots=True)
class ConversationTurn:
    """Where a response in a conversation attaches, and the dialogue its prompt renders."""

    target: TurnTarget
    messages: list[dict[str, Any]]


def _text(content: object) -> str:
    """A message's text: its string, or its text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p)
    return ""


def item_message(item: Mapping[str, Any]) -> dict[str, Any]:
    """A message item (`{"id", "role", "content": [parts]}`) as the stored message the chat
    template renders, keeping its id (a developer message is the template's system role)."""
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidInput(
            f"a conversation item is a message of role user, assistant, system or developer, not {role!r}"
        )
    return {
        "role": "system" if role == "developer" else role,
        "content": _text(item.get("content")),
        "id": item["id"],
    }


def message_item(message: Mapping[str, Any], item_id: str) -> dict[str, Any]:
    """A stored message as a conversation item (OpenAI's message item)."""
    role = message.get("role")
    text = _text(message.get("content"))
    part: dict[str, Any] = (
        {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        if role == "assistant"
        else {"type": "input_text", "text": text}
    )
    return {"id": item_id, "type": "message", "role": role, "status": "completed", "content": [part]}


def _item_ids(messages: Sequence[Mapping[str, Any]]) -> list[str | None]:
    """Each stored message's item id (None: the instructions, which are not an item). An id-less
    message's is derived from the items up to it, the instructions left out: a response's
    instructions, added or changed, do not move the ids of the items before it."""
    digests = iter(prefix_digests([m for m in messages if not m.get(INSTRUCTIONS_KEY)])[1:])
    out: list[str | None] = []
    for m in messages:
        if m.get(INSTRUCTIONS_KEY):
            out.append(None)
        else:
            given, digest = m.get("id"), next(digests)
            out.append(given if isinstance(given, str) else derived_item_id(digest))
    return out


def dialogue_items(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The items of a stored dialogue, oldest first (the instructions left out)."""
    return [message_item(m, i) for m, i in zip(messages, _item_ids(messages), strict=True) if i is not None]


def _check_new(
    stored: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]], max_items: int | None
) -> None:
    seen = {i for i in _item_ids(stored) if i is not None}
    for m in new:
        if m["id"] in seen:
            raise InvalidInput(f"the conversation already holds an item with id {m['id']!r}")
        seen.add(m["id"])
    if max_items is not None and len(seen) > max_items:
        raise LimitExceeded(
            f"the conversation would hold {len(seen)} items, over this server's limit of {max_items}",
            field="items",
        )


class Conversations:
    """The Conversations API's state over the version store (see the module docstring)."""

    def __init__(self, versions: VersionStore) -> None:
        self._versions = versions

    def _session(self, user: UserId, cid: SessionId) -> SessionInfo:
        try:
            return self._versions.get_session(user, cid)
        except SessionNotFound:
            raise ConversationNotFound(f"conversation {cid!r} not found") from None

    @staticmethod
    def _of(session: SessionInfo) -> Conversation:
        head = session.branch(MAIN_BRANCH).head_version
        return Conversation(session.id, session.created_at, session.metadata, head)

    def _messages(self, user: UserId, cid: SessionId, head: int) -> list[dict[str, Any]]:
        if head == EMPTY_HEAD:
            return []
        return self._versions.get_version(user, cid, head).messages

    def create(
        self,
        user: UserId,
        items: Sequence[Mapping[str, Any]],
        metadata: Mapping[str, Any] | None,
        max_items: int | None = None,
        *,
        epoch: int | None = None,
        route_key: str | None = None,
    ) -> Conversation:
        """A new conversation (a session with a fresh `conv_` id that begins with `route_key`,
        `dss.dialogue.route_keys`), seeded with `items` as its first version when there are any.
        All or nothing: a seed refused by the store removes the session.
        `epoch`: the erasure epoch the request was admitted under (see the module docstring)."""
        new = [item_message(i) for i in items]
        _check_new([], new, max_items)
        cid = new_conversation_id(route_key)
        session = self._versions.create_session(user, cid, metadata=metadata, epoch=epoch)
        if not new:
            return self._of(session)
        try:
            v = self._versions.commit(
                user, cid, tokens=[], messages=new, branch=MAIN_BRANCH, expected_head=EMPTY_HEAD, epoch=epoch
            )
        except BaseException:
            # An erasure between the two deleted it already: the seed's error is the answer.
            with contextlib.suppress(SessionNotFound, UserErased):
                self._versions.delete_session(user, cid)
            raise
        return Conversation(cid, session.created_at, session.metadata, v.number)

    def get(self, user: UserId, cid: SessionId) -> Conversation:
        return self._of(self._session(user, cid))

    def set_metadata(
        self,
        user: UserId,
        cid: SessionId,
        metadata: Mapping[str, Any] | None,
        *,
        epoch: int | None = None,
    ) -> Conversation:
        try:
            return self._of(self._versions.set_metadata(user, cid, metadata, epoch=epoch))
        except SessionNotFound:
            raise ConversationNotFound(f"conversation {cid!r} not found") from None

    def items(self, user: UserId, cid: SessionId) -> list[dict[str, Any]]:
        """Every item, oldest first."""
        conv = self.get(user, cid)
        return dialogue_items(self._messages(user, cid, conv.head))

    def page(
        self,
        user: UserId,
        cid: SessionId,
        limit: int,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> ItemPage:
        """`limit` items in `order` after the item `after` (an id it does not hold: none)."""
        items = self.items(user, cid)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        return ItemPage(items[:limit], len(items) > limit)

    def item(self, user: UserId, cid: SessionId, item_id: str) -> dict[str, Any]:
        for it in self.items(user, cid):
            if it["id"] == item_id:
                return it
        raise ConversationItemNotFound(f"conversation {cid!r} holds no item {item_id!r}")

    def append(
        self,
        user: UserId,
        cid: SessionId,
        items: Sequence[Mapping[str, Any]],
        max_items: int | None = None,
        *,
        epoch: int | None = None,
    ) -> list[dict[str, Any]]:
        """Add `items` at the end: a new version on `main` (its messages: the head's, then these);
        returns the added items as they read from now on. `epoch`: as for `create`."""
        conv = self.get(user, cid)
        stored = self._messages(user, cid, conv.head)
        new = [item_message(i) for i in items]
        _check_new(stored, new, max_items)
        messages = [*stored, *new]
        self._versions.commit(
            user, cid, tokens=[], messages=messages, branch=MAIN_BRANCH, expected_head=conv.head, epoch=epoch
        )
        return dialogue_items(messages)[-len(new) :] if new else []

    def delete_item(
        self, user: UserId, cid: SessionId, item_id: str, *, epoch: int | None = None
    ) -> Conversation:
        """A new version on `main` without the item (the versions that held it stay). `epoch`: as
        for `create`."""
        conv = self.get(user, cid)
        stored = self._messages(user, cid, conv.head)
        ids = _item_ids(stored)
        if item_id not in ids:
            raise ConversationItemNotFound(f"conversation {cid!r} holds no item {item_id!r}")
        at = ids.index(item_id)
        v = self._versions.commit(
            user,
            cid,
            tokens=[],
            messages=[*stored[:at], *stored[at + 1 :]],
            branch=MAIN_BRANCH,
            expected_head=conv.head,
            epoch=epoch,
        )
        return Conversation(conv.id, conv.created_at, conv.metadata, v.number)

    def turn(
        self,
        user: UserId,
        cid: SessionId,
        instructions: str | None,
        new_messages: Sequence[Mapping[str, Any]],
        lead_policy: LeadPolicy | None = None,
    ) -> ConversationTurn:
        """Where a response in the conversation attaches (a child of `main`'s head, on `main`) and
        its dialogue: this response's instructions, the items, then its input (`new_messages`,
        each with its item id). Its prompt continues from the deepest version that stores token
        ids and whose messages start that dialogue; or, when the instructions changed since the
        head's, from the deepest one whose messages start it but for them (a lead update when
        `lead_policy` allows: `TurnTarget.lead`)."""
        conv = self.get(user, cid)
        stored = self._messages(user, cid, conv.head)
        new = [dict(m) for m in new_messages]
        _check_new(stored, new, None)
        lead = (
            [{"role": "system", "content": instructions, INSTRUCTIONS_KEY: True}]
            if instructions is not None
            else []
        )
        items = [m for m in stored if not m.get(INSTRUCTIONS_KEY)]
        messages = [*lead, *items, *new]
        base = self._versions.find_deepest_prefix_version(user, cid, messages, holding_tokens=True)
        drift = None
        if lead and stored and stored[0].get(INSTRUCTIONS_KEY) and stored[0] != lead[0]:
            probe = [stored[0], *items, *new]
            found = self._versions.find_deepest_prefix_version(user, cid, probe, holding_tokens=True)
            if found is not None and len(found.messages) > max(1, len(base.messages) if base else 0):
                base = found
                drift = classify(lead_policy or LeadPolicy(), stored[0], lead[0])
        parent = conv.head if conv.head != EMPTY_HEAD else None
        target = TurnTarget(conv.id, parent, MAIN_BRANCH, fork_on_race=False, base=base, lead=drift)
        return ConversationTurn(target, messages)
