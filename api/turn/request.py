"""A turn as a route asks for it, admitted and resolved into a `Turn`.

One typed request per way of asking (`ChatTurn`, `MessageTurn`, `ResponseTurn`,
`ConversationTurn`): the route parses its body into one, and the turn is served from it
(`api.turn.respond`). Admitting a turn (`admit`) takes its generation slot on arrival, before any
work, and reads who it runs as once: the user's erasure epoch, its tenant and its prefix-cache
salt. Resolving it (`TurnRequest.resolve`) reads the session, the version the turn extends and
its branch, and the whole dialogue its prompt renders, in a worker thread, under that epoch
(`dss.dialogue.turns` holds the rules).

Each resolver checks the limits table (`check_limits`) once, on the whole dialogue, as soon as it
knows it and before anything is written: a chat turn's request is its whole dialogue, and
resolving it may open its session, so it is checked first; a stateful or Responses turn's
dialogue is the stored one plus the new input, known only after reading (which writes nothing).
The request's text (no NUL, no lone surrogate) was checked before its route ran
(`api.deps.check_request_text`), and stored messages when they were stored.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sized
from dataclasses import dataclass, field
from typing import Any

from api.http_errors import EngineOverloaded, UserSlotsExhausted
from api.llm.chat_engine import ChatEngine
from api.llm.slots import Slot
from api.settings import LimitsSettings
from api.state import AppState
from dss.dialogue.lead.policy import LeadPolicy
from dss.dialogue.turns import TurnTarget, chat_target, message_target, response_target
from dss.errors import LimitExceeded
from dss.jsonlimits import JsonLimits, check_items, check_json
from dss.types import SessionId, TenantId, UserId


# ---------------------------------------------------------------------------------- the turn
@dataclass(frozen=True, slots=True)
class Admitted:
    """Who a turn runs as, read once when it is admitted (`admit`): the user's erasure epoch, and
    that epoch's tenant and prefix-cache salt. Every write the turn makes is refused
    (`UserErased`) once the user was erased since, however far the turn got."""

    epoch: int
    tenant: TenantId
    salt: str


@dataclass(frozen=True, slots=True)
class TurnParams:
    """What DSS itself reads of a request's generation fields (vLLM reads the rest: `fields`)."""

    max_tokens: int | None = None  # as asked for (None: the server's default)
    stop: tuple[str, ...] = ()
    n: int = 1


@dataclass(frozen=True, slots=True)
class Turn:
    """A turn resolved: whose, its whole dialogue, where it commits."""

    user: UserId
    admitted: Admitted
    messages: list[dict[str, Any]]  # the whole dialogue the prompt renders
    params: TurnParams
    target: TurnTarget | None  # None: a plain chat without a session, or an unstored response
    # The request's honoured OpenAI fields (`api.shapes.openai_fields`), converted by vLLM's
    # request model.
    fields: Mapping[str, Any] = field(default_factory=dict)
    # False: the store neither loads nor saves this turn's KV (a Responses `store: false`).
    persist: bool = True
    # `truncation: "auto"`: a dialogue that outgrew the context is shortened (`api.turn.truncate`).
    truncate: bool = False
    # The id its answer is stored with (a conversation's output item: `dss.dialogue.conversations`
    # keeps each item's id in its message). None: the answer is stored without one.
    answer_item_id: str | None = None


# ------------------------------------------------------------------------------ the requests
@dataclass(frozen=True, slots=True, kw_only=True)
class TurnRequest(ABC):
    """What every turn request carries besides its dialogue."""

    user: UserId
    params: TurnParams
    fields: Mapping[str, Any]  # the honoured OpenAI fields, for vLLM's request model
    stream: bool = False
    truncate: bool = False  # `truncation: "auto"` (`api.turn.truncate`)

    @abstractmethod
    async def resolve(self, state: AppState, admitted: Admitted) -> Turn:
        """The turn: its target and whole dialogue, read under the admitted epoch; the limits
        checked on it before anything is written."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatTurn(TurnRequest):
    """A Chat Completions turn: the client sends the whole dialogue; with a session, the turn
    attaches where that dialogue's history was stored (or forks where it was edited; or, when
    only its lead changed, extends that version: `api.turn.lead`)."""

    messages: list[dict[str, Any]]
    session_id: SessionId | None
    state_version: int | None
    lead: LeadPolicy

    async def resolve(self, state: AppState, admitted: Admitted) -> Turn:
        check_limits(state.settings.limits, self.params, self.messages, self.fields)
        target = None
        if self.session_id is not None:
            target = await asyncio.to_thread(
                chat_target,
                state.store.versions,
                self.user,
                self.session_id,
                self.messages,
                self.state_version,
                admitted.epoch,
                self.lead,
            )
        # Answers the client sent back trimmed are committed (and continued from) as generated.
        messages = target.dialogue if target is not None and target.dialogue is not None else self.messages
        return Turn(self.user, admitted, messages, self.params, target, self.fields)


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageTurn(TurnRequest):
    """A stateful turn: the stored dialogue of the branch (or version), then the new message."""

    session_id: SessionId
    branch: str | None
    version: int | None
    text: str

    async def resolve(self, state: AppState, admitted: Admitted) -> Turn:
        target, base = await asyncio.to_thread(
            message_target, state.store.versions, self.user, self.session_id, self.branch, self.version
        )
        messages = [*base, {"role": "user", "content": self.text}]
        check_limits(state.settings.limits, self.params, messages, self.fields)
        return Turn(self.user, admitted, messages, self.params, target, self.fields, truncate=self.truncate)


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseTurn(TurnRequest):
    """A Responses turn: the chain of `previous_response_id` (a session of its own), the
    instructions, then the new input items. `store: false` keeps nothing, not even KV: the
    connector neither loads nor saves it."""

    previous_response_id: str | None
    instructions: str | None
    new: list[dict[str, Any]]
    store: bool
    lead: LeadPolicy
    route_key: str | None = None  # a new chain's session carries it (`dss.dialogue.route_keys`)

    async def resolve(self, state: AppState, admitted: Admitted) -> Turn:
        planned = await asyncio.to_thread(
            response_target,
            state.store.versions,
            state.store.responses,
            self.user,
            self.previous_response_id,
            self.instructions,
            self.new,
            self.store,
            self.lead,
            self.route_key,
        )
        check_limits(state.settings.limits, self.params, planned.messages, self.fields)
        return Turn(
            self.user,
            admitted,
            planned.messages,
            self.params,
            planned.target,
            self.fields,
            persist=self.store,
            truncate=self.truncate,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationTurn(TurnRequest):
    """A Responses turn in a conversation (`dss.dialogue.conversations`): the instructions, the
    conversation's items, then the new input items (each message keeps its item id, and the
    answer is stored under `answer_item_id`); committed on the conversation's `main`."""

    conversation_id: SessionId
    instructions: str | None
    new: list[dict[str, Any]]
    answer_item_id: str
    lead: LeadPolicy

    async def resolve(self, state: AppState, admitted: Admitted) -> Turn:
        planned = await asyncio.to_thread(
            state.store.conversations.turn,
            self.user,
            self.conversation_id,
            self.instructions,
            self.new,
            self.lead,
        )
        check_limits(state.settings.limits, self.params, planned.messages, self.fields)
        return Turn(
            self.user,
            admitted,
            planned.messages,
            self.params,
            planned.target,
            self.fields,
            truncate=self.truncate,
            answer_item_id=self.answer_item_id,
        )


# ---------------------------------------------------------------------------------- admission
def take_slot(state: AppState, engine: ChatEngine, user: UserId) -> Slot:
    """The request's generation slot, counted in `user`'s share (an end user of a frontend key:
    their own share, not the frontend's): 503 beyond `max_inflight`, 429 beyond the user's
    `max_slots_per_user`."""
    try:
        return engine.slots.admit(user)
    except UserSlotsExhausted:
        state.metrics.rejected_user_share.inc()
        raise
    except EngineOverloaded:
        state.metrics.rejected.inc()
        raise


async def admit(state: AppState, engine: ChatEngine, user: UserId) -> tuple[Slot, Admitted]:
    """Admit a turn: its generation slot, before any work and before its response starts
    (streaming or not, so a burst beyond `max_inflight` gets its 503s at once), then who it runs
    as, read once, before it reads or writes anything. The caller gives the slot back."""
    slot = take_slot(state, engine, user)
    try:
        return slot, await asyncio.to_thread(_admitted, state, user)
    except BaseException:
        slot.release()
        raise


def _admitted(state: AppState, user: UserId) -> Admitted:
    identity = state.store.identity
    epoch = identity.epoch_of(user)
    return Admitted(epoch, identity.tenant_at(user, epoch), identity.cache_salt(user, epoch))


# ------------------------------------------------------------------------------------- limits
def check_limits(
    lim: LimitsSettings,
    params: TurnParams,
    messages: list[dict[str, Any]],
    fields: Mapping[str, Any] | None = None,
) -> None:
    """The limits table on a turn's request, before any work for it: every 400 names the field
    and the limit. `fields`: the honoured OpenAI fields passed to vLLM."""
    json_limits, entry_limits = lim.json_limits, lim.entry_limits
    # First (its JSON bounds before anything walks the messages recursively).
    _check_dialogue(lim, json_limits, messages, "messages")
    for name, (setting, most) in entry_limits.items():
        value = (fields or {}).get(name)
        if isinstance(value, Sized) and not isinstance(value, str) and len(value) > most:
            raise LimitExceeded(
                f"`{name}` has {len(value)} entries, over this server's limit of {most} ({setting})",
                field=name,
            )
    for name, value in (fields or {}).items():
        if isinstance(value, Mapping | list | tuple):
            check_json(name, value, json_limits)
    if len(params.stop) > lim.max_stop_sequences:
        raise LimitExceeded(f"{len(params.stop)} stop sequences exceed the limit of {lim.max_stop_sequences}")
    wanted = params.max_tokens
    if wanted is not None and wanted > lim.max_output_tokens:
        raise LimitExceeded(f"max_tokens {wanted} exceeds this server's limit of {lim.max_output_tokens}")
    if params.n > lim.max_n:
        raise LimitExceeded(f"n={params.n} exceeds this server's limit of {lim.max_n} alternatives")


def check_dialogue(lim: LimitsSettings, messages: list[dict[str, Any]], where: str = "messages") -> None:
    """The limits on a dialogue's messages (also on what a conversation stores, which every later
    turn renders): the JSON bounds (first: what follows walks the values recursively), at most
    `max_messages`, none over `max_message_chars`."""
    _check_dialogue(lim, lim.json_limits, messages, where)


def _check_dialogue(
    lim: LimitsSettings, json_limits: JsonLimits, messages: list[dict[str, Any]], where: str
) -> None:
    check_items(where, messages, json_limits)
    if len(messages) > lim.max_messages:
        raise LimitExceeded(f"{len(messages)} messages exceed the limit of {lim.max_messages}", field=where)
    longest = max((len(str(m.get("content") or "")) for m in messages), default=0)
    if longest > lim.max_message_chars:
        raise LimitExceeded(
            f"a message of {longest} characters exceeds the limit of {lim.max_message_chars}", field=where
        )
