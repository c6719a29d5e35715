"""A turn that extends a version starts from the version's stored token ids, with the default
model's real tokenizer and chat template (no engine: prompts only)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest

from api.llm.chat_engine import ChatEngine
from api.turn.pipeline import prompt_for
from api.turn.request import Admitted, Turn, TurnParams
from dss.dialogue.turns import TurnTarget
from dss.dialogue.versions import VersionInfo
from dss.types import FingerprintId, SessionId, TenantId, UserId
from tests.api_server import model_dir

FID = FingerprintId("fp-test")
Q1 = {"role": "user", "content": "Describe your goal in one word."}
Q2 = {"role": "user", "content": "Why?"}
ADMITTED = Admitted(0, TenantId("t"), "t")


@pytest.fixture(scope="module")
def engine() -> ChatEngine:
    path = model_dir()
    if path is None:
        pytest.skip("the default model is not prepared (make model)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    return ChatEngine(
        None,
        tok,
        model_name="m",
        max_model_len=8192,
        fingerprint=FID,
        max_inflight=1,
        retry_after_s=1,
        tag_key=b"k" * 32,
    )


def enc(engine: ChatEngine, text: str) -> list[int]:
    return engine.encode(text)


def eos(engine: ChatEngine) -> int:
    return int(engine.tokenizer.convert_tokens_to_ids("<|im_end|>"))


def version(tokens: list[int], messages: list[dict[str, Any]], fingerprint: str | None = FID) -> VersionInfo:
    return VersionInfo(
        session_id=SessionId("s"),
        number=1,
        parent=None,
        branch="main",
        created_at=datetime.now(UTC),
        n_tokens=len(tokens),
        fingerprint=fingerprint,
        tokens=np.asarray(tokens, dtype=np.int32),
        messages=messages,
    )


def turn(base: VersionInfo, messages: list[dict[str, Any]]) -> Turn:
    target = TurnTarget(SessionId("s"), 1, "main", fork_on_race=True, base=base)
    return Turn(UserId("u"), ADMITTED, messages, TurnParams(), target)


def test_an_answer_whose_ids_do_not_round_trip_is_continued_from_its_ids(engine: ChatEngine) -> None:
    # Sampling produced "Par" "is"; the text "Paris" is one token.
    generated = [*enc(engine, "Par"), *enc(engine, "is"), *enc(engine, "."), eos(engine)]
    answer = {"role": "assistant", "content": "Paris."}
    assert enc(engine, "Paris.") != generated[:-1], "precondition: the ids do not round-trip"
    stored = [*engine.render([Q1]), *generated]
    base = version(stored, [Q1, answer])

    prompt = prompt_for(engine, turn(base, [Q1, answer, Q2])).ids
    rerendered = engine.render([Q1, answer, Q2])
    assert prompt[: len(stored)] == stored  # every stored token is reused as is
    first_diff = next(i for i, (a, b) in enumerate(zip(stored, rerendered, strict=False)) if a != b)
    assert first_diff < len(stored) - 1  # the old way lost everything from inside the answer
    # The text is the template's, token for token after the stored ids.
    assert engine.decode(prompt) == engine.render_text([Q1, answer, Q2])
    assert prompt[len(stored) :] == enc(engine, "\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")


def test_where_ids_round_trip_the_continuation_equals_the_rendered_dialogue(engine: ChatEngine) -> None:
    answer = {"role": "assistant", "content": "Clarity, because it helps."}
    stored = [*engine.render([Q1]), *enc(engine, answer["content"]), eos(engine)]
    base = version(stored, [Q1, answer])
    assert prompt_for(engine, turn(base, [Q1, answer, Q2])).ids == engine.render([Q1, answer, Q2])


def test_an_answer_cut_by_max_tokens_gets_the_end_token_the_template_writes(engine: ChatEngine) -> None:
    answer = {"role": "assistant", "content": "Clarity, bec"}
    stored = [*engine.render([Q1]), *enc(engine, "Clarity"), *enc(engine, ", bec")]  # no end token
    base = version(stored, [Q1, answer])
    prompt = prompt_for(engine, turn(base, [Q1, answer, Q2])).ids
    assert prompt[: len(stored)] == stored and prompt[len(stored)] == eos(engine)
    assert engine.decode(prompt) == engine.render_text([Q1, answer, Q2])


def test_stored_ids_that_run_past_the_answer_text_fall_back_to_rendering(engine: ChatEngine) -> None:
    # A stop string: the answer's text stops before "Paris", its generated ids do not.
    answer = {"role": "assistant", "content": "The capital is "}
    stored = [*engine.render([Q1]), *enc(engine, "The capital is Paris"), eos(engine)]
    base = version(stored, [Q1, answer])
    assert prompt_for(engine, turn(base, [Q1, answer, Q2])).ids == engine.render([Q1, answer, Q2])


def test_ids_of_another_model_are_never_continued(engine: ChatEngine) -> None:
    generated = [*enc(engine, "Par"), *enc(engine, "is"), eos(engine)]
    answer = {"role": "assistant", "content": "Paris"}
    stored = [*engine.render([Q1]), *generated]
    for other in (version(stored, [Q1, answer], "another-model"), version(stored, [Q1, answer], None)):
        assert prompt_for(engine, turn(other, [Q1, answer, Q2])).ids == engine.render([Q1, answer, Q2])
    no_base = replace(turn(version(stored, [Q1, answer]), [Q1, answer, Q2]).target, base=None)
    t = Turn(UserId("u"), ADMITTED, [Q1, answer, Q2], TurnParams(), no_base)
    assert prompt_for(engine, t).ids == engine.render([Q1, answer, Q2])
