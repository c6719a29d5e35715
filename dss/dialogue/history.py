"""A version's messages, stored once across the version tree.

Each version row keeps only the messages it adds to its parent's (`messages_base` = how many of
the parent's it starts with; 0 means the row holds the whole list, for a root or for a commit
that does not extend its parent), so a session of n turns stores O(n) messages, not O(n^2). A
row whose first message, its lead (the system prompt a frontend re-templates every turn), is not
its parent's but whose other messages extend the parent's stores that lead apart (`lead`) and
the rest as a delta: a chat whose system prompt carries the time stays O(n) too.

`digest` chains over the whole list: d(0) is a constant and d(i) = H(d(i-1) || message i), so
the digests of every prefix of a request are computed in one pass, and "the deepest version
whose messages are a prefix of these" is one indexed lookup of those digests instead of a read
of every version's messages.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_SEED = hashlib.sha256(b"dss messages v1").digest()


def _canonical(message: Mapping[str, Any]) -> bytes:
    # Sorted keys: stored messages compare as dicts, so key order must not change the digest.
    # ASCII escapes: any str encodes, lone surrogates included.
    return json.dumps(message, sort_keys=True, ensure_ascii=True, separators=(",", ":")).encode()


def prefix_digests(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """`out[i]` is the digest of `messages[:i]`, for i in 0..len(messages)."""
    state = _SEED
    out = [state.hex()]
    for m in messages:
        state = hashlib.sha256(state + _canonical(m)).digest()
        out.append(state.hex())
    return out


@dataclass(frozen=True, slots=True)
class StoredMessages:
    """What a version row stores of its messages."""

    delta: list[dict[str, Any]]
    base: int  # messages taken from the parent before `delta`
    n_messages: int
    digest: str
    lead: dict[str, Any] | None = None  # the first message, in place of the parent's


def stored_form(
    messages: list[dict[str, Any]],
    parent_n_messages: int | None,
    parent_digest: str | None,
    parent_lead: Mapping[str, Any] | None = None,
) -> StoredMessages:
    """The row form of `messages` committed on a parent with that count and digest (None: no
    parent). When the parent's messages are not a prefix of these, the whole list is stored,
    unless they are with the first message swapped for `parent_lead` (the parent's first message,
    as the caller believes it: the digest decides): then the row's own first message is kept as
    `lead` and the rest as a delta."""
    digests = prefix_digests(messages)
    if parent_n_messages is None or not 0 < parent_n_messages <= len(messages):
        return StoredMessages(messages, 0, len(messages), digests[-1])
    if digests[parent_n_messages] == parent_digest:
        return StoredMessages(messages[parent_n_messages:], parent_n_messages, len(messages), digests[-1])
    if parent_lead is not None and parent_n_messages > 1:
        swapped = prefix_digests([dict(parent_lead), *messages[1:parent_n_messages]])
        if swapped[-1] == parent_digest:
            delta = messages[parent_n_messages:]
            return StoredMessages(delta, parent_n_messages, len(messages), digests[-1], messages[0])
    return StoredMessages(messages, 0, len(messages), digests[-1])


def with_lead(messages: list[dict[str, Any]], lead: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """`messages` with a row's own lead in place of the first (inherited) one."""
    return messages if lead is None else [dict(lead), *messages[1:]]


def rebuild(
    chain: Iterable[tuple[int, list[dict[str, Any]], Mapping[str, Any] | None]],
) -> list[dict[str, Any]]:
    """The whole message list from `(base, delta, lead)` rows, oldest first, the first with base 0."""
    out: list[dict[str, Any]] = []
    for base, delta, lead in chain:
        out = with_lead(out[:base] + list(delta), lead)
    return out
