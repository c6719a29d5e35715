"""The quality gate's shadow checks of lead updates (`dss.dialogue.lead.gate` keeps the figures).

After a turn served as a lead update has been answered and committed, a sample of such turns
(`DSS_LEAD__GATE_SAMPLE`) is checked in the background when a generation slot is free: the first
`gate_tokens` tokens are generated greedily, with the first token's top-20 probabilities, from
the prompt as served and from the exact prompt (the whole dialogue rendered with the new lead),
and compared. Neither generation is stored (no session tag: the connector neither loads nor
saves them) and neither holds up a request: a check that finds no free slot is skipped and
counted. A check that trips the gate logs it once; the frontend's later turns are then not
served as lead updates (`quality_gate_tripped`) until `POST /v1/admin/lead-gate/{frontend}/reset`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import random
import time
from collections.abc import Sequence
from typing import Any

from api.http_errors import ApiError
from api.llm.chat_engine import ChatEngine
from api.llm.generation import Finished, generate
from api.state import AppState
from api.turn.lead import PromptPlan
from api.turn.request import Turn
from dss.dialogue.lead.gate import Check, total_variation
from dss.dialogue.lead.view import ModelView
from dss.errors import DSSError

log = logging.getLogger("dss.api.lead")
TOP = 20
_RUNNING: set[asyncio.Task[None]] = set()  # referenced until done (the loop keeps weak refs only)


def maybe_check(state: AppState, engine: ChatEngine, turn: Turn, plan: PromptPlan) -> None:
    """Start a shadow check of this turn (its prompt as served: `plan`) when it was served as a
    lead update and is sampled."""
    lead = plan.lead
    settings = state.settings.lead
    if lead is None or not lead.served or settings.gate_sample <= 0 or turn.fields.get("tools"):
        return  # (a turn with tools: the exact prompt would need them rendered too; not sampled)
    if random.random() >= settings.gate_sample:
        return
    if engine.slots.inflight >= engine.slots.limit:
        state.metrics.lead_gate_checks.labels("skipped").inc()
        return
    task = asyncio.create_task(_check(state, engine, turn, plan), context=contextvars.Context())
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)


async def _check(state: AppState, engine: ChatEngine, turn: Turn, plan: PromptPlan) -> None:
    assert plan.lead is not None
    frontend = plan.lead.frontend
    k = state.settings.lead.gate_tokens
    try:
        sampling = engine.sampling(
            turn.messages, {"temperature": 0, "logprobs": True, "top_logprobs": TOP}, k
        )
        # The exact prompt: the dialogue with the new lead and no update (less the messages a
        # truncation left out, as the served prompt does).
        exact = ModelView(dropped=ModelView.of(plan.seen).dropped).seen(turn.messages)
        exact_ids = await asyncio.to_thread(engine.render, exact)
        served_fin = await _first_tokens(engine, turn, plan.ids, sampling)
        exact_fin = await _first_tokens(engine, turn, exact_ids, sampling)
    except (ApiError, DSSError) as exc:  # no slot free, the engine refused: no figure
        log.info("lead-update quality check skipped: %s", exc)
        state.metrics.lead_gate_checks.labels("skipped").inc()
        return
    check = compare(served_fin, exact_fin, k)
    state.metrics.lead_gate_checks.labels("yes" if check.first_agrees else "no").inc()
    if state.lead_gate.record(frontend, check):
        state.metrics.lead_gate_tripped.inc()
        log.warning(
            "lead updates OFF for %s: the quality gate's first-token agreement with the exact prompt "
            "fell below %.2f (or its distance rose above %.2f); re-arm with "
            "POST /v1/admin/lead-gate/{frontend}/reset",
            frontend,
            state.lead_gate.min_agreement,
            state.lead_gate.max_distance,
        )


async def _first_tokens(engine: ChatEngine, turn: Turn, ids: Sequence[int], sampling: Any) -> Finished:
    async with engine.slots.admitted(strict=True):
        events = generate(
            engine,
            ids,
            sampling,
            tenant=turn.admitted.tenant,
            cache_salt=turn.admitted.salt,
            session_id=None,
            arrived=time.perf_counter(),
            persist=False,
        )
        async with contextlib.aclosing(events) as evs:
            async for ev in evs:
                if isinstance(ev, Finished):
                    return ev
    raise ApiError("the shadow generation ended without an answer")


def compare(served: Finished, exact: Finished, k: int) -> Check:
    a, b = served.output_ids[:k], exact.output_ids[:k]
    first = bool(a) and bool(b) and a[0] == b[0]
    return Check(first, first and a == b, total_variation(_first_probs(served), _first_probs(exact)))


def _first_probs(fin: Finished) -> dict[int, float]:
    if not fin.logprobs:
        return {}
    step = fin.logprobs[0] or {}
    return {int(tok): math.exp(float(lp.logprob)) for tok, lp in step.items()}
