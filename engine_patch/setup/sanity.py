"""The sanity set: short questions with one unambiguous answer, asked through vLLM as it serves.

`dss model pull` verifies a model with it: one vLLM engine (no DSS connector), in the dtype that
will be served, all questions in one greedy batch through the model's chat template. A question
passes when its answer contains the expected word (whole word, case-insensitive). A 135M model
that is correct in one dtype can tip into a wrong answer in another (the default model's first
token of "What is the capital of France?" is a near-tie in bfloat16, 0.125 nats), which is why
the check runs vLLM, not transformers, and in the served dtype. See docs/operations.md, "Served dtype".

Like `engine_patch.setup.model`, importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dss.errors import ModelVerificationFailed


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    answers: tuple[str, ...]  # any of these words, matched whole and case-insensitively

    def check(self, answer: str) -> bool:
        return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", answer, re.IGNORECASE) for a in self.answers)


# Questions the default model answers right at full precision (float32, where vLLM's answers are
# transformers' answers, word for word). Left out: those it gets wrong in every dtype, being a
# Q4_1-derived 135M model (the capitals of Italy, Spain and the United States, the colour of grass,
# bananas and snow, the largest planet, a spider's legs, 3 + 5, the king of the jungle).
SANITY_SET: tuple[Question, ...] = (
    Question("What is the capital of France?", ("Paris",)),
    Question("What is the capital of Japan?", ("Tokyo",)),  # the README's example
    Question("What is the capital of Germany?", ("Berlin",)),
    Question("What is the capital of the United Kingdom?", ("London",)),
    Question("What is the capital of Russia?", ("Moscow",)),
    Question("What is the capital of Egypt?", ("Cairo",)),
    Question("What is 2 + 2?", ("4", "four")),
    Question("What colour is the sky on a clear day?", ("blue",)),
    Question("How many days are there in a week?", ("7", "seven")),
    Question("How many months are there in a year?", ("12", "twelve")),
    Question("How many hours are there in a day?", ("24", "twenty-four")),
    Question("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    Question("What is the opposite of hot?", ("cold",)),
    Question("What is the opposite of up?", ("down",)),
    Question("What is the chemical symbol for gold?", ("Au",)),
    Question("What is the chemical formula of water?", ("H2O",)),
)

# Passing needs at least this many right. Measured on the default model in bfloat16, the served
# dtype (docs/operations.md, "Served dtype"): 15/16 on this machine (the months of a year wrong),
# 14/16 in an earlier measurement (France too). Its greedy answers to France, 2 + 2, the sky and
# the days of a week hinge on a first choice that beats the second by 0.125-0.25 nats, which
# bfloat16 rounding on other hardware can tip; 13 allows one more such tip than measured. A
# model that is broken (wrong weights, template or dtype handling) scores far lower. float32
# scores 16/16. The README's example (Japan) wins every token by >= 2.5 nats.
DEFAULT_MIN_CORRECT = len(SANITY_SET) - 3
MAX_NEW_TOKENS = 32


@dataclass(frozen=True, slots=True)
class SanityReport:
    dtype: str
    answers: tuple[tuple[Question, str], ...]

    @property
    def correct(self) -> int:
        return sum(q.check(a) for q, a in self.answers)

    @property
    def total(self) -> int:
        return len(self.answers)

    @property
    def wrong(self) -> list[tuple[Question, str]]:
        return [(q, a) for q, a in self.answers if not q.check(a)]

    def summary(self) -> str:
        return f"sanity {self.correct}/{self.total} ({self.dtype})"

    def require(self, min_correct: int, model: Path | str) -> SanityReport:
        """Self when at least `min_correct` answers are right; else `ModelVerificationFailed`
        with a one-line message naming the score and the first wrong answers."""
        if self.correct >= min_correct:
            return self
        shown = "; ".join(f"{q.text!r} -> {a[:60]!r}" for q, a in self.wrong[:3])
        more = f" (+{len(self.wrong) - 3} more)" if len(self.wrong) > 3 else ""
        wrong = f"; wrong: {shown}{more}" if shown else ""
        raise ModelVerificationFailed(
            f"model at {model} failed verification: {self.summary()}, needs {min_correct}/{self.total}{wrong}"
        )


def score(dtype: str, questions: Sequence[Question], answers: Sequence[str]) -> SanityReport:
    return SanityReport(dtype, tuple(zip(questions, (a.strip() for a in answers), strict=True)))


def ask(llm: Any, questions: Sequence[Question] = SANITY_SET, max_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    """The greedy answers of a running vLLM `LLM` to `questions`, in one batch."""
    from vllm import SamplingParams

    conversations = [[{"role": "user", "content": q.text}] for q in questions]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs = llm.chat(conversations, params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def run_sanity(
    model: Path,
    dtype: str | None = None,
    questions: Sequence[Question] = SANITY_SET,
    kv_cache_space_gib: int = 1,
) -> SanityReport:
    """Start one plain vLLM engine on `model` in `dtype` (default: the served default,
    `EngineSettings.dtype`), ask `questions`, stop the engine, return the report."""
    from engine_patch.setup.factory import EngineSettings, build_llm

    settings = EngineSettings(
        model=Path(model),
        max_model_len=512,
        kv_cache_space_gib=kv_cache_space_gib,
        enable_prefix_caching=False,
        connector=False,
    )
    if dtype is not None:
        settings = dataclasses.replace(settings, dtype=dtype)
    with _quiet_vllm():
        llm = build_llm(None, None, settings)
    try:
        answers = ask(llm, questions)
    finally:
        shutdown(llm)
    return score(settings.dtype, questions, answers)


def shutdown(llm: Any) -> None:
    """Stop an `LLM`'s engine processes now (not whenever the garbage collector gets to them)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
    del llm
    gc.collect()


@contextlib.contextmanager
def _quiet_vllm() -> Iterator[None]:
    """vLLM logs its start-up at INFO on stdout; a CLI wants only warnings (an explicit
    `VLLM_LOGGING_LEVEL` wins). Read when vLLM is first imported, and by its engine processes."""
    key = "VLLM_LOGGING_LEVEL"
    if key in os.environ:
        yield
        return
    os.environ[key] = "WARNING"
    try:
        yield
    finally:
        os.environ.pop(key, None)
