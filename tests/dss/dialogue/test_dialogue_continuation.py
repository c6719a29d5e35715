"""The continuation rule (`dss.dialogue.continuation`), as pure functions over text and ids."""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np

from dss.dialogue.continuation import continuation_text, extended_messages
from dss.dialogue.versions import VersionInfo
from dss.types import FingerprintId, SessionId

FID = FingerprintId("fp")
Q1 = {"role": "user", "content": "Hi"}
A1 = {"role": "assistant", "content": "Hello."}
Q2 = {"role": "user", "content": "Why?"}


def version(n_tokens: int, messages: list[dict[str, str]], fingerprint: str | None = FID) -> VersionInfo:
    return VersionInfo(
        session_id=SessionId("s"),
        number=1,
        parent=None,
        branch="main",
        created_at=datetime.now(UTC),
        n_tokens=n_tokens,
        fingerprint=fingerprint,
        tokens=np.zeros(n_tokens, dtype=np.int32),
        messages=messages,
    )


def test_the_text_after_the_stored_ids_closes_the_answer_then_adds_the_new_turn() -> None:
    before = "<u>Hi</u><a>Hello.</a>\n"
    after = before + "<u>Why?</u><a>"
    assert continuation_text("<u>Hi</u><a>Hello.</a>", before, after) == "\n<u>Why?</u><a>"
    assert continuation_text(before, before, after) == "<u>Why?</u><a>"


def test_no_continuation_when_the_ids_are_not_the_start_or_the_template_rewrites_history() -> None:
    before = "<u>Hi</u><a>Hello.</a>\n"
    assert continuation_text("<u>Hi</u><a>Hello. And", before, before + "<u>Why?</u>") is None
    assert continuation_text("<u>Hi</u>", before, "<sys/>" + before + "<u>Why?</u>") is None


def test_a_turn_extends_a_version_of_the_same_model_whose_messages_it_starts_with() -> None:
    base = version(5, [Q1, A1])
    assert extended_messages(base, [Q1, A1, Q2], FID) == 2
    assert extended_messages(base, [Q1, A1], FID) is None  # nothing new
    assert extended_messages(base, [Q1, {**A1, "content": "Edited."}, Q2], FID) is None
    assert extended_messages(base, [Q1, A1, Q2], FingerprintId("other")) is None
    assert extended_messages(base, [Q1, A1, Q2], None) is None
    assert extended_messages(version(0, [Q1, A1]), [Q1, A1, Q2], FID) is None  # no stored ids
    assert extended_messages(None, [Q1, A1, Q2], FID) is None
