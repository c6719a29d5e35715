"""The limits table on a turn: every 400 names the field and the limit.

Checked once per turn, by the turn's resolver (`api.turn.target`), on the whole dialogue the
prompt renders (for a stateful or Responses turn: the stored one and the new input) with the
request's own fields, before anything is written, rendered or generated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import Any

from api.settings import LimitsSettings
from api.shapes.schemas import GenerationParams
from dss.dialogue.turn_commits import check_text
from dss.errors import LimitExceeded
from dss.jsonlimits import check_items, check_json


def check_limits(
    lim: LimitsSettings,
    params: GenerationParams,
    messages: list[dict[str, Any]],
    fields: Mapping[str, Any] | None = None,
) -> None:
    """The limits table on a turn's request, before any work for it: every 400 names the field
    and the limit. `fields`: the honoured OpenAI fields passed to vLLM."""
    json_limits = lim.json_limits()
    # First (its JSON bounds before anything walks the messages recursively).
    check_dialogue(lim, messages)
    for name, (setting, most) in lim.entry_limits().items():
        value = (fields or {}).get(name)
        if isinstance(value, Sized) and not isinstance(value, str) and len(value) > most:
            raise LimitExceeded(
                f"`{name}` has {len(value)} entries, over this server's limit of {most} ({setting})",
                field=name,
            )
    for name, value in (fields or {}).items():
        if isinstance(value, Mapping | list | tuple):
            check_json(name, value, json_limits)
    check_text(list(params.stop or []), "stop")
    stops = params.stop or []
    if len(stops) > lim.max_stop_sequences:
        raise LimitExceeded(f"{len(stops)} stop sequences exceed the limit of {lim.max_stop_sequences}")
    wanted = params.requested_max_tokens
    if wanted is not None and wanted > lim.max_output_tokens:
        raise LimitExceeded(f"max_tokens {wanted} exceeds this server's limit of {lim.max_output_tokens}")
    if params.n > lim.max_n:
        raise LimitExceeded(f"n={params.n} exceeds this server's limit of {lim.max_n} alternatives")


def check_dialogue(lim: LimitsSettings, messages: list[dict[str, Any]], where: str = "messages") -> None:
    """The limits on a dialogue's messages (also on what a conversation stores, which every later
    turn renders): the JSON bounds (first: what follows walks the values recursively), valid
    text, at most `max_messages`, none over `max_message_chars`."""
    check_items(where, messages, lim.json_limits())
    check_text(messages, where)
    if len(messages) > lim.max_messages:
        raise LimitExceeded(f"{len(messages)} messages exceed the limit of {lim.max_messages}", field=where)
    longest = max((len(str(m.get("content") or "")) for m in messages), default=0)
    if longest > lim.max_message_chars:
        raise LimitExceeded(
            f"a message of {longest} characters exceeds the limit of {lim.max_message_chars}", field=where
        )
