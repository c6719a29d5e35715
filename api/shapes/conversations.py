"""The Conversations API's wire shapes: its request bodies and OpenAI's conversation and item-list
objects. The state behind them is `dss.dialogue.conversations` (a conversation is a session).

The conversation object follows OpenAI's (`created_at` a Unix time); DSS adds `dss`: the session
and the version of `main` whose messages are the items now.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.shapes.openai_responses import InputMessage, check_metadata
from dss.dialogue.conversations import MAX_ITEMS_PER_REQUEST, Conversation


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ConversationCreate(_Request):
    """`POST /v1/conversations`: optional items to seed it with, optional metadata."""

    items: list[InputMessage] | None = Field(default=None, max_length=MAX_ITEMS_PER_REQUEST)
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(v)


class ConversationUpdate(_Request):
    """`POST /v1/conversations/{id}`: the metadata replaces the conversation's (null: none)."""

    metadata: dict[str, str] | None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(v)


class ItemsCreate(_Request):
    """`POST /v1/conversations/{id}/items`: the items to add at the end."""

    items: list[InputMessage] = Field(min_length=1, max_length=MAX_ITEMS_PER_REQUEST)


def conversation_body(c: Conversation) -> dict[str, Any]:
    return {
        "id": c.id,
        "object": "conversation",
        "created_at": int(c.created_at.timestamp()),
        "metadata": c.metadata,
        "dss": {"session_id": c.id, "version": c.head or None, "branch": "main"},
    }


def deleted_body(cid: str) -> dict[str, Any]:
    return {"id": cid, "object": "conversation.deleted", "deleted": True}


def item_list(items: Sequence[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's list of conversation items (`first_id`/`last_id`: the page's ends, None when empty)."""
    return {
        "object": "list",
        "data": list(items),
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }
