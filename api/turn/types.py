"""What the steps of a turn hand each other: the turn resolved, the turn prepared, an answer."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from api.llm.generation import Finished
from api.llm.sampling import Sampling
from api.shapes.schemas import GenerationParams
from api.turn.lead import LeadReport
from dss.dialogue.turn_commits import TurnTarget
from dss.types import TenantId, UserId


@dataclass(frozen=True, slots=True)
class Turn:
    user: UserId
    messages: list[dict[str, Any]]  # the whole dialogue the prompt renders
    params: GenerationParams
    target: TurnTarget | None  # None: a plain chat without a session
    # The request's honoured OpenAI fields (`api.shapes.openai_fields`), converted by vLLM's request
    # model.
    fields: Mapping[str, Any] = field(default_factory=dict)
    # False: the store neither loads nor saves this turn's KV (a Responses `store: false`).
    persist: bool = True
    # The user's erasure epoch when the turn was admitted (`admit.admitted_epoch`): its tenant, and
    # every write it makes is refused (`UserErased`) once the user was erased since, however
    # far the turn got (prepared, generating, committing). None: whatever the epoch is then.
    epoch: int | None = None
    # `truncation: "auto"`: a dialogue that outgrew the context is shortened (`api.turn.truncate`).
    truncate: bool = False
    # The id its answer is stored with (a conversation's output item: `dss.dialogue.conversations`
    # keeps each item's id in its message). None: the answer is stored without one.
    answer_item_id: str | None = None


@dataclass(frozen=True, slots=True)
class Prepared:
    prompt_ids: list[int]
    sampling: Sampling
    tenant: TenantId
    salt: str
    completion_id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    # What the model saw of the committed messages where it differs (`dss.dialogue.lead.view`).
    seen: dict[str, Any] | None = None
    # The turn's lead changed: served as a lead update or not, and why (`api.turn.lead`).
    lead: LeadReport | None = None
    truncated: int = 0  # history messages the prompt left out (`truncation: "auto"`)


@dataclass(frozen=True, slots=True)
class Answer:
    """One finished choice as the client sees it (tool calls split off by the parser, if any)."""

    fin: Finished
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str | None

    @property
    def stored_message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or ""}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg

    def stored_as(self, item_id: str | None) -> dict[str, Any]:
        """`stored_message`, with the item id it is stored under when it has one."""
        return self.stored_message if item_id is None else {**self.stored_message, "id": item_id}
