"""The continuation rule: a turn that extends a version continues from the version's stored
token ids, not from its messages rendered again.

A version stores the token ids its KV cache holds: its prompt and its answer as generated, end
token included. Generated ids do not always survive a round trip through text ("A|im|ing" comes
back as "Aiming"), so a prompt re-rendered from the messages can differ from the stored ids early
in the answer, and every page from there on would be recomputed. So the next turn's prompt is the
stored ids exactly, then the chat template's text for the new messages, tokenized.

Pure functions over a stored version and templated text, calling nothing back: the caller renders
the template, decodes the stored ids and tokenizes the result with the model's tokenizer
(`api.llm.chat_engine.ChatEngine.continue_from`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dss.dialogue.versions import VersionInfo
from dss.types import FingerprintId


def extended_messages(
    base: VersionInfo | None,
    messages: Sequence[Mapping[str, Any]],
    fingerprint: FingerprintId | None,
    lead_updated: bool = False,
) -> int | None:
    """How many of `messages` are the stored version `base`'s own, when the turn continues from
    its stored ids: the version holds ids of the model serving now (same fingerprint), and the
    turn's dialogue is the version's messages followed by new ones (`lead_updated`: all of them
    but the first, the lead, which the turn states anew after them). None: render it whole."""
    if not continuable(base, fingerprint):
        return None
    assert base is not None
    n = len(base.messages)
    first = 1 if lead_updated else 0
    if len(messages) > n and list(messages[first:n]) == base.messages[first:]:
        return n
    return None


def continuable(base: VersionInfo | None, fingerprint: FingerprintId | None) -> bool:
    """The version holds token ids of the model serving now."""
    return (
        base is not None
        and bool(base.n_tokens)
        and fingerprint is not None
        and base.fingerprint == fingerprint
    )


def continuation_text(stored_text: str, before: str, after: str) -> str | None:
    """What follows a version's stored ids in the prompt of a turn that extends it, as text
    for the caller to tokenize and append to the stored ids.

    `stored_text`: the stored ids decoded exactly (special tokens included); `before`: the
    template's text of the version's messages (no generation prompt); `after`: its text of the
    version's and the new messages, with the generation prompt. None when the stored ids are not
    the start of what the template writes for the version's messages (a stop string cut the
    answer's text short of its tokens, say), or when the template rewrites earlier turns as one
    is added: the caller then renders the whole dialogue. Where the ids round-trip, the stored
    ids and this text tokenized equal the whole dialogue rendered and tokenized.
    """
    if not after.startswith(before) or not before.startswith(stored_text):
        return None
    # What the template writes after the stored ids: the rest of the closing of the answer (the
    # newline after its end token, or the end token itself for an answer cut by max_tokens),
    # then the new messages and the generation prompt.
    return before[len(stored_text) :] + after[len(before) :]
