"""A version's messages, stored once across the version tree.

Each version row keeps only the messages it adds to its parent's (`messages_base` = how many of
the parent's it starts with; 0 means the row holds the whole list, for a root or for a commit
that does not extend its parent), so a session of n turns stores O(n) messages, not O(n^2).

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


def stored_form(
    messages: list[dict[str, Any]], parent_n_messages: int | None, parent_digest: str | None
) -> StoredMessages:
    """The row form of `messages` committed on a parent with that count and digest (None: no
    parent). When the parent's messages are not a prefix of these, the whole list is stored."""
    digests = prefix_digests(messages)
    base = 0
    if (
        parent_n_messages is not None
        and 0 < parent_n_messages <= len(messages)
        and digests[parent_n_messages] == parent_digest
    ):
        base = parent_n_messages
    return StoredMessages(messages[base:], base, len(messages), digests[-1])


def rebuild(chain: Iterable[tuple[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """The whole message list from `(base, delta)` rows, oldest first, the first with base 0."""
    out: list[dict[str, Any]] = []
    for base, delta in chain:
        out = out[:base] + list(delta)
    return out
