"""Where a chat turn attaches in a session's version tree, and committing it there.

A turn extends one version (its parent) and is committed on a branch whose head is that parent.
When no branch head is the parent (the client edited history, or named an older version), the
commit creates a new branch (`fork-...`) at the parent first, so no existing branch is rewritten.
All of this runs after the generation: a turn that is cancelled leaves no branch and no version.

Every write here takes the erasure epoch the turn was admitted under (`epoch`; None: any): a turn
whose user was erased after its admission, while it was prepared, generated or committed, writes
nothing (`UserErased`), even where its commit would create the session anew.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dss.dialogue.echoes import as_stored, recent_versions
from dss.dialogue.lead.match import drifted_base
from dss.dialogue.lead.policy import LeadDrift, LeadPolicy, classify, has_lead
from dss.dialogue.response_store import ResponseRecord, ResponseStore
from dss.dialogue.route_keys import checked_route_key, new_route_key
from dss.dialogue.versions import EMPTY_HEAD, MAIN_BRANCH, SessionInfo, VersionInfo, VersionStore
from dss.errors import (
    BranchExists,
    DSSError,
    ForkNamesExhausted,
    StaleHead,
    StateVersionMismatch,
)
from dss.types import SessionId, UserId

_MAX_FORK_NAMES = 64
_MAX_COMMIT_TRIES = 4


@dataclass(frozen=True, slots=True)
class TurnTarget:
    session_id: SessionId
    parent: int | None  # the version the turn extends; None = a first turn (a root version)
    branch: str | None  # the branch to commit on; None = fork a new branch at `parent`
    fork_on_race: bool  # if the branch head moves meanwhile: fork (True) or answer 409 (False)
    # The version whose stored token ids start the turn's prompt: the parent itself, or (in a
    # conversation, whose added items are versions of messages only) the deepest version holding
    # ids whose messages start the turn's dialogue.
    base: VersionInfo | None = field(default=None, compare=False, repr=False)
    # The session does not exist yet (a new response chain): the first commit creates it, so a
    # turn that fails before its commit leaves no empty session behind.
    create_session: bool = False
    # The turn's dialogue equals `base`'s but for its lead (system prompt, instructions): served
    # as a lead update on `base` when `lead.served`, else rendered whole (and `lead.reason` says
    # why); None when the lead did not change.
    lead: LeadDrift | None = field(default=None, compare=False)
    # The turn's dialogue as it attaches, when it is not the request's messages: answers the
    # client sent back with the whitespace around them trimmed, taken back in their stored form
    # (`dss.dialogue.echoes`); `echoed` says how many. None: the request's messages.
    dialogue: list[dict[str, Any]] | None = field(default=None, compare=False, repr=False)
    echoed: int = 0

    @property
    def expected_head(self) -> int:
        return self.parent if self.parent is not None else EMPTY_HEAD


@dataclass(frozen=True, slots=True)
class Committed:
    version: VersionInfo
    branch: str


def plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [dict(m) for m in messages]


def branch_at(session: SessionInfo, version: int | None) -> str | None:
    """A branch whose head is `version` (`main` first), or None."""
    head = version if version is not None else EMPTY_HEAD
    if session.branch(MAIN_BRANCH).head_version == head:
        return MAIN_BRANCH
    for b in session.branches:
        if b.head_version == head:
            return b.name
    return None


def open_session(
    versions: VersionStore, user: UserId, sid: SessionId, epoch: int | None = None
) -> SessionInfo:
    """The user's session, created on first use (ids are per user: another user's do not matter)."""
    return versions.ensure_session(user, sid, epoch=epoch)[0]


def chat_target(
    versions: VersionStore,
    user: UserId,
    sid: SessionId,
    messages: Sequence[Mapping[str, Any]],
    state_version: int | None,
    epoch: int | None = None,
    lead_policy: LeadPolicy | None = None,
) -> TurnTarget:
    """Where a `/v1/chat/completions` turn with the full `messages` attaches: the deepest
    version its messages extend, once answers the client sent back trimmed are taken back in
    their stored form (`dss.dialogue.echoes`: `TurnTarget.dialogue`); or, when a deeper one
    matches all but the lead, that one (the turn is a lead update on it when `lead_policy`
    allows: `TurnTarget.lead`)."""
    session = open_session(versions, user, sid, epoch)
    if state_version is not None:
        base = versions.get_version(user, sid, state_version)
        stored = base.messages
        if len(messages) <= len(stored) or plain_messages(messages[: len(stored)]) != stored:
            raise StateVersionMismatch(
                f"the messages do not extend version {state_version}: send its {len(stored)} messages "
                "followed by the new ones"
            )
        return TurnTarget(
            session.id, state_version, branch_at(session, state_version), fork_on_race=True, base=base
        )
    found = versions.find_deepest_prefix_version(user, sid, messages)
    depth = len(found.messages) if found is not None else 0
    lead, reconciled = None, None
    if depth < len(messages) - 1:  # matched short: an echoed answer, a moved lead, or an edit
        recent = recent_versions(versions, user, session)
        reconciled = as_stored(messages, recent)
        if reconciled is not None:
            messages = reconciled.messages
            found = versions.find_deepest_prefix_version(user, sid, messages)
            depth = len(found.messages) if found is not None else 0
        if has_lead(messages) and depth < len(messages) - 1:
            drifted = drifted_base(versions, user, session.id, messages, depth, recent)
            if drifted is not None:
                # Attached to the version it continues even when not served from it: the session's
                # tree stays the conversation's, not a new root each time the lead moves.
                found = drifted
                lead = classify(lead_policy or LeadPolicy(), drifted.messages[0], messages[0])
    parent = found.number if found is not None else None
    return TurnTarget(
        session.id,
        parent,
        branch_at(session, parent),
        fork_on_race=True,
        base=found,
        lead=lead,
        dialogue=reconciled.messages if reconciled is not None else None,
        echoed=reconciled.echoed if reconciled is not None else 0,
    )


def message_target(
    versions: VersionStore, user: UserId, sid: SessionId, branch: str | None, version: int | None
) -> tuple[TurnTarget, list[dict[str, Any]]]:
    """Where a stateful `/messages` turn attaches, and the dialogue it continues."""
    session = versions.get_session(user, sid)
    if version is not None:
        base = versions.get_version(user, sid, version)
        target = TurnTarget(session.id, version, branch_at(session, version), fork_on_race=True, base=base)
        return target, base.messages
    name = branch or MAIN_BRANCH
    head = session.branch(name).head_version
    if head == EMPTY_HEAD:
        start = [{"role": "system", "content": session.system_prompt}] if session.system_prompt else []
        return TurnTarget(session.id, None, name, fork_on_race=False), start
    base = versions.get_version(user, sid, head)
    return TurnTarget(session.id, head, name, fork_on_race=False, base=base), base.messages


@dataclass(frozen=True, slots=True)
class ResponseTurn:
    """Where a Responses API turn attaches, and the dialogue its prompt renders."""

    target: TurnTarget | None  # None: a response that is not stored (`store: false`)
    messages: list[dict[str, Any]]
    previous: ResponseRecord | None


def response_dialogue(
    versions: VersionStore,
    responses: ResponseStore,
    user: UserId,
    previous_response_id: str | None,
    instructions: str | None,
    new_messages: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], ResponseRecord | None, VersionInfo | None]:
    """The dialogue a response's prompt renders, the response it continues and that one's version.

    `instructions` hold for this response only, as in OpenAI's API: the previous response's
    instructions (its leading system message) are not carried over, this one's lead the
    dialogue. With the same instructions as before, the dialogue extends the stored one exactly,
    and the turn continues from the stored token ids."""
    lead = [{"role": "system", "content": instructions}] if instructions is not None else []
    if previous_response_id is None:
        return [*lead, *plain_messages(new_messages)], None, None
    previous = responses.get(user, previous_response_id)
    base = versions.get_version(user, previous.session_id, previous.version)
    history = list(base.messages)
    if previous.instructions is not None and history and history[0].get("role") == "system":
        history = history[1:]
    return [*lead, *history, *plain_messages(new_messages)], previous, base


def response_target(
    versions: VersionStore,
    responses: ResponseStore,
    user: UserId,
    previous_response_id: str | None,
    instructions: str | None,
    new_messages: Sequence[Mapping[str, Any]],
    store: bool = True,
    lead_policy: LeadPolicy | None = None,
    route_key: str | None = None,
) -> ResponseTurn:
    """A response without `previous_response_id` starts a new chain: a new session (created by
    its commit, named `resp-` and `route_key`, the chain's: `dss.dialogue.route_keys`) whose
    first version it becomes. One with it continues that response's version:
    on its branch when it is that branch's head, else on a new branch forked there (a fork of
    the response tree). Unstored (`store` false), it only reads the dialogue it continues.
    Instructions that differ from the previous response's are a lead update on its version when
    `lead_policy` allows (`TurnTarget.lead`)."""
    messages, previous, base = response_dialogue(
        versions, responses, user, previous_response_id, instructions, new_messages
    )
    if not store:
        return ResponseTurn(None, messages, previous)
    if previous is None or base is None:
        sid = SessionId(f"resp-{checked_route_key(route_key) or new_route_key()}{uuid.uuid4().hex[:16]}")
        target = TurnTarget(sid, None, MAIN_BRANCH, fork_on_race=False, create_session=True)
        return ResponseTurn(target, messages, None)
    session = versions.get_session(user, previous.session_id)
    lead = None
    if has_lead(base.messages) and has_lead(messages) and base.messages[0] != messages[0]:
        lead = classify(lead_policy or LeadPolicy(), base.messages[0], messages[0])
    target = TurnTarget(
        session.id,
        previous.version,
        branch_at(session, previous.version),
        fork_on_race=True,
        base=base,
        lead=lead,
    )
    return ResponseTurn(target, messages, previous)


def commit_alternatives(
    versions: VersionStore,
    user: UserId,
    target: TurnTarget,
    choices: Sequence[tuple[np.ndarray, Sequence[Mapping[str, Any]]]],
    fingerprint: str | None,
    epoch: int | None = None,
    seen: Mapping[str, Any] | None = None,
) -> list[Committed]:
    """Commit each choice of a turn (its tokens and messages; `seen`, what the model saw where
    it differs, the same for every choice) as a version: the first where the
    turn attaches, every other as a sibling on a branch of its own forked at the same parent.

    All or nothing: when a commit fails (a quota, a race lost for good), the versions committed
    before it are deleted again, which moves their branch heads back, unless another writer has
    built on one meanwhile (that one then stays, as any committed version). The branches forked
    for them stay, at the parent."""
    done: list[Committed] = []
    try:
        for i, (tokens, messages) in enumerate(choices):
            where = (
                target if i == 0 else replace(target, branch=None, fork_on_race=True, create_session=False)
            )
            done.append(commit_turn(versions, user, where, tokens, messages, fingerprint, epoch, seen))
    except BaseException:
        for c in reversed(done):
            forget_version(versions, user, target.session_id, c.version.number)
        raise
    return done


def forget_version(versions: VersionStore, user: UserId, sid: SessionId, number: int) -> bool:
    """Delete a version this turn committed but cannot stand by, if nothing was built on it yet."""
    try:
        if versions.subtree(user, sid, number) != [number]:
            return False
        versions.delete_subtree(user, sid, number)
        return True
    except DSSError:
        return False


def add_response(
    versions: VersionStore, responses: ResponseStore, record: ResponseRecord, epoch: int | None = None
) -> None:
    """Record a response for the version its turn committed. When the record cannot be added,
    the version goes again (`forget_version`): no version is left without its response."""
    try:
        responses.add(record, epoch=epoch)
    except BaseException:
        forget_version(versions, record.user, record.session_id, record.version)
        raise


def commit_turn(
    versions: VersionStore,
    user: UserId,
    target: TurnTarget,
    tokens: np.ndarray,
    messages: Sequence[Mapping[str, Any]],
    fingerprint: str | None,
    epoch: int | None = None,
    seen: Mapping[str, Any] | None = None,
) -> Committed:
    """Commit the finished turn as a child of `target.parent`, forking a branch when needed
    (and creating the session first when the target says it does not exist yet)."""
    if target.create_session:
        versions.ensure_session(user, target.session_id, epoch=epoch)
    for _ in range(_MAX_COMMIT_TRIES):
        branch = target.branch
        if branch is None:
            branch = _fork(versions, user, target, epoch)
        try:
            v = versions.commit(
                user,
                target.session_id,
                tokens=tokens,
                messages=messages,
                branch=branch,
                expected_head=target.expected_head,
                fingerprint=fingerprint,
                epoch=epoch,
                seen=seen,
                parent_lead=_lead_of(target.base),
            )
            return Committed(v, branch)
        except StaleHead:
            if not target.fork_on_race:
                raise
            target = replace(target, branch=None)
    raise StaleHead(f"session {target.session_id!r} kept moving under the commit; retry the request")


def _lead_of(base: VersionInfo | None) -> dict[str, Any] | None:
    return dict(base.messages[0]) if base is not None and has_lead(base.messages) else None


def _fork(versions: VersionStore, user: UserId, target: TurnTarget, epoch: int | None) -> str:
    stem = f"fork-v{target.parent}" if target.parent is not None else "fork-root"
    for i in range(_MAX_FORK_NAMES):
        name = stem if i == 0 else f"{stem}-{i + 1}"
        try:
            versions.branch(user, target.session_id, target.expected_head, name, epoch=epoch)
            return name
        except BranchExists:
            continue
    raise ForkNamesExhausted(f"could not find a free branch name for a fork of {stem}")
