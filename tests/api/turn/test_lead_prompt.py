"""The prompt of a lead-update turn under the chat templates of the main families (issue 27): the
stored ids as they were, then the update where the template takes it, never a template error.

The templates are written here after the role rules of the ones the model families ship (no model
hub here): Llama 3 and Qwen 2.5 render a system message anywhere; Mistral's and Gemma's refuse
roles that do not alternate after the first system message (a late system message raises), and
Mistral's moves the system prompt into the last user turn (no turn extends the one before). The
tokenizer is the default model's (no engine: prompts only)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest

from api.llm.chat_engine import ChatEngine
from api.turn.lead import plan_prompt
from dss.dialogue.lead.policy import TEMPLATE, LeadPolicy, classify
from dss.dialogue.lead.view import ModelView
from dss.dialogue.turns import TurnTarget
from dss.dialogue.versions import VersionInfo
from dss.types import FingerprintId, SessionId
from tests.api.turn.test_continuation import engine

__all__ = ["engine"]

FID = FingerprintId("fp-test")

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL = (
    "{% if messages[0]['role'] == 'system' %}{% set system_message = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}"
    "{{ bos_token }}{% for m in loop_messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('After the optional system message, roles must alternate user/assistant') }}"
    "{% endif %}"
    "{% if m['role'] == 'user' %}{% if loop.last and system_message is defined %}"
    "[INST] {{ system_message }}\n\n{{ m['content'] }}[/INST]"
    "{% else %}[INST] {{ m['content'] }}[/INST]{% endif %}"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/model/user/model/...') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ prefix if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# family: (template, the placement a `system` preference gets, or None: rendered whole)
FAMILIES = {
    "llama3": (LLAMA3, "system"),
    "qwen": (QWEN, "system"),
    "gemma": (GEMMA, "note"),
    "mistral": (MISTRAL, None),
}
OLD = {"role": "system", "content": "You are helpful.\nCurrent date and time: 2026-12-05 09:14:02"}
NEW = {"role": "system", "content": "You are helpful.\nCurrent date and time: 2026-12-05 09:14:49"}
Q1 = {"role": "user", "content": "What is a good name for a cat?"}
A1 = {"role": "assistant", "content": "Whiskers."}
Q2 = {"role": "user", "content": "What time is it?"}


def with_template(base: ChatEngine, template: str) -> ChatEngine:
    tok = copy.copy(base.tokenizer)
    tok.chat_template = template
    return ChatEngine(
        None, tok, model_name="m", max_model_len=8192, fingerprint=FID, max_inflight=1, retry_after_s=1,
        tag_key=b"k" * 32,
    )  # fmt: skip


def stored_version(
    engine: ChatEngine, messages: list[dict[str, Any]], seen: dict[str, Any] | None = None
) -> VersionInfo:
    """A version as a turn stores it: its prompt as the model saw it, then the answer's ids."""
    shown = ModelView.of(seen).seen(messages)
    ids = engine.encode(engine.render_text(shown[:-1]) + shown[-1]["content"])
    return VersionInfo(
        session_id=SessionId("s"), number=1, parent=None, branch="main", created_at=datetime.now(UTC),
        n_tokens=len(ids), fingerprint=FID, tokens=np.asarray(ids, dtype=np.int32),
        messages=messages, seen=seen,
    )  # fmt: skip


def drift_target(base: VersionInfo, new_lead: dict[str, Any]) -> TurnTarget:
    drift = classify(LeadPolicy("volatile"), base.messages[0], new_lead)
    return TurnTarget(SessionId("s"), 1, "main", fork_on_race=True, base=base, lead=drift)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("placement", ["system", "note"])
def test_the_update_follows_the_stored_ids_where_the_template_takes_it(
    engine: ChatEngine, family: str, placement: str
) -> None:
    template, system_gets = FAMILIES[family]
    eng = with_template(engine, template)
    base = stored_version(eng, [OLD, Q1, A1])
    plan = plan_prompt(eng, drift_target(base, NEW), [NEW, Q1, A1, Q2], (), placement)
    assert plan.lead is not None
    if system_gets is None:  # no turn extends the last: rendered whole, and it says so
        assert (plan.lead.served, plan.lead.reason) == (False, TEMPLATE)
        assert plan.ids == eng.render([NEW, Q1, A1, Q2]) and plan.seen is None
        return
    expected = placement if placement == "note" else system_gets
    assert plan.lead.served and plan.lead.placement == expected
    stored = base.tokens.tolist()
    assert plan.ids[: len(stored)] == stored  # the history's ids exactly as computed
    tail = eng.decode(plan.ids[len(stored) :])
    assert "Current date and time: 2026-12-05 09:14:49" in tail and "09:14:02" not in tail
    assert tail.index("09:14:49") < tail.index("What time is it?")
    # The version records what the model saw, and the next turn continues from it.
    seen = ModelView.of(plan.seen).seen([NEW, Q1, A1, Q2])
    assert seen[0] == OLD and eng.decode(plan.ids) == eng.render_text(seen)
    later = stored_version(eng, [NEW, Q1, A1, Q2, A1], plan.seen)
    plan2 = plan_prompt(
        eng, TurnTarget(SessionId("s"), 2, "main", True, base=later), [NEW, Q1, A1, Q2, A1, Q1], (), placement
    )
    assert plan2.ids[: later.n_tokens] == later.tokens.tolist() and plan2.lead is None
    assert plan2.seen == plan.seen
