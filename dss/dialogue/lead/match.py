"""The stored version a dialogue extends when only its lead differs from the stored one.

The exact match (`VersionReads.find_deepest_prefix_version`) is one indexed lookup of the
request's prefix digests; those digests chain over the lead, so a changed lead matches nothing
beyond it. Here the request is probed again with the leads a continuing client most likely
extends: those of the session's most recent branch heads and of their parents (a regenerated
answer extends a head's parent: `dss.dialogue.echoes.recent_versions`, read once per turn). Each
probe is the same indexed lookup with the request's lead swapped for a stored one. Bounded: at
most `dss.dialogue.echoes.MAX_PROBED_HEADS` heads, so at most twice as many distinct-lead
lookups per turn, and only for a turn whose exact match did not reach its last stored message.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from dss.dialogue.lead.policy import has_lead, same_but_lead
from dss.dialogue.versions import VersionInfo, VersionStore
from dss.types import SessionId, UserId

AUTO_SESSION_PREFIX = "auto-"


def content_session_id(messages: Sequence[Mapping[str, Any]]) -> SessionId | None:
    """The session of a chat that names none (LibreChat sends only `user`), named by its content:
    its first user message. Every turn of that chat repeats it, so every turn finds the same
    session, where the turn attaches as usual (a lead update when only the lead changed). Per
    user, as every session id: two chats of one person that open with the same message share a
    session and become branches of one tree where they part. None: no user message."""
    first = next((m for m in messages if m.get("role") == "user"), None)
    if first is None:
        return None
    canonical = json.dumps(first, sort_keys=True, ensure_ascii=True, separators=(",", ":")).encode()
    return SessionId(AUTO_SESSION_PREFIX + hashlib.sha256(canonical).hexdigest()[:32])


def drifted_base(
    versions: VersionStore,
    user: UserId,
    sid: SessionId,
    messages: Sequence[Mapping[str, Any]],
    exact_depth: int,
    recent: Sequence[VersionInfo],
) -> VersionInfo | None:
    """The deepest version holding token ids whose messages equal `messages`' first ones but for
    the lead, when it is deeper than `exact_depth` (how many messages the exact match covered);
    else None. The leads probed are those of `recent` (`dss.dialogue.echoes.recent_versions`)."""
    if not has_lead(messages):
        return None
    best: VersionInfo | None = None
    for lead in _leads(recent):
        if lead == messages[0] or not same_but_lead(lead, messages[0]):
            continue
        probe = [lead, *messages[1:]]
        found = versions.find_deepest_prefix_version(user, sid, probe, holding_tokens=True)
        if found is None or len(found.messages) <= max(exact_depth, 1):
            continue
        if best is None or len(found.messages) > len(best.messages):
            best = found
    return best


def _leads(recent: Sequence[VersionInfo]) -> list[dict[str, Any]]:
    leads: list[dict[str, Any]] = []
    for version in recent:
        if has_lead(version.messages) and version.messages[0] not in leads:
            leads.append(dict(version.messages[0]))
    return leads
