"""Answers as a chat frontend sends them back.

A client that sends the whole dialogue every turn (Chat Completions) repeats the model's earlier
answers as it kept them, which is not always as they were generated: Open WebUI trims the
whitespace around every answer it keeps (`.strip()` on the answer's last text part in its
middleware, 0.12), so an answer that ended in a newline comes back without it. Compared exactly,
such a turn matched no stored version beyond its first messages and became a new root: the
session's tree lost the conversation, and the turn rendered its whole dialogue again instead of
continuing from the stored ids.

Here a request's dialogue is reconciled with the versions a continuing client most likely
extends (`recent_versions`: the session's most recent branch heads and their parents, the same
bounded set the lead probe reads): an assistant message that equals a stored answer but for the
whitespace around its text, all its other fields equal, is that answer echoed, and the stored
message takes its place. The turn then extends that version exactly: its prompt continues from
the stored ids (the answer as generated, which is what the model saw), and its version stores the
answer in that form too. Nothing else is tolerated; a reconciled turn says how many answers it
took back (`TurnTarget.echoed`, `dss.echoed_answers` on the wire).

Pure but for `recent_versions`, which reads the store (through `VersionStore`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dss.dialogue.lead.policy import LEAD_ROLES, same_but_lead
from dss.dialogue.versions import EMPTY_HEAD, SessionInfo, VersionInfo, VersionStore
from dss.errors import VersionNotFound
from dss.types import SessionId, UserId

MAX_PROBED_HEADS = 4  # at most twice as many versions read per turn that matched short


def recent_versions(versions: VersionStore, user: UserId, session: SessionInfo) -> list[VersionInfo]:
    """The session's `MAX_PROBED_HEADS` most recent branch heads, each followed by its parent (a
    continuing client extends a head; a regenerated answer extends a head's parent)."""
    heads = sorted({b.head_version for b in session.branches if b.head_version != EMPTY_HEAD}, reverse=True)
    read: dict[int, VersionInfo] = {}
    for number in heads[:MAX_PROBED_HEADS]:
        head = _read(versions, user, session.id, number, read)
        if head is not None and head.parent is not None:
            _read(versions, user, session.id, head.parent, read)
    return list(read.values())


def _read(
    versions: VersionStore, user: UserId, sid: SessionId, number: int, read: dict[int, VersionInfo]
) -> VersionInfo | None:
    if number not in read:
        try:
            read[number] = versions.get_version(user, sid, number)
        except VersionNotFound:  # deleted meanwhile
            return None
    return read[number]


@dataclass(frozen=True, slots=True)
class Reconciled:
    """A request's dialogue with the answers it echoed replaced by the stored ones."""

    messages: list[dict[str, Any]]
    echoed: int  # how many answers were taken back in their stored form


def as_stored(messages: Sequence[Mapping[str, Any]], recent: Sequence[VersionInfo]) -> Reconciled | None:
    """`messages` reconciled with the recent version it agrees with furthest (a lead that differs
    in content only counts as agreeing: `dss.dialogue.lead.match` decides about it), when that
    took back at least one echoed answer; else None."""
    best: Reconciled | None = None
    best_depth = 0
    for version in recent:
        out, echoed, depth = _reconcile(messages, version.messages)
        if echoed and depth > best_depth:
            best, best_depth = Reconciled(out, echoed), depth
    return best


def echoes(stored: Mapping[str, Any], sent: Mapping[str, Any]) -> bool:
    """`sent` is the stored answer but for the whitespace around its text."""
    if stored.get("role") != "assistant" or sent.get("role") != "assistant":
        return False
    old, new = stored.get("content"), sent.get("content")
    if not isinstance(old, str) or not isinstance(new, str) or old == new or old.strip() != new.strip():
        return False
    return all(stored.get(k) == sent.get(k) for k in (set(stored) | set(sent)) - {"content"})


def _reconcile(
    messages: Sequence[Mapping[str, Any]], stored: Sequence[Mapping[str, Any]]
) -> tuple[list[dict[str, Any]], int, int]:
    """The messages with the echoes of `stored`'s answers replaced, how many, and how many
    leading messages agree with `stored`."""
    out = [dict(m) for m in messages]
    echoed = depth = 0
    for i, (sent, kept) in enumerate(zip(messages, stored, strict=False)):
        if sent == kept or (i == 0 and sent.get("role") in LEAD_ROLES and same_but_lead(kept, sent)):
            pass
        elif echoes(kept, sent):
            out[i] = dict(kept)
            echoed += 1
        else:
            break
        depth = i + 1
    return out, echoed, depth
