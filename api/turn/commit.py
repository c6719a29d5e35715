"""Commit a turn: observe it in the metrics and, in a session, commit each choice as a version.

A turn's versions are committed only after its last token was generated (and, when streaming,
sent); a client that goes away earlier cancels the generation and nothing is committed. A turn
with `n` choices commits each one as a version: siblings under the same parent, each on a
branch of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import numpy as np

from api.llm.chat_engine import ChatEngine
from api.llm.generation import Finished
from api.shapes.usage import dss_info
from api.state import AppState
from api.turn.lead_gate import maybe_check
from api.turn.types import Answer, Prepared, Turn
from dss.dialogue.turn_commits import Committed, commit_alternatives
from dss.tokens import TOKEN_DTYPE


async def commit(
    state: AppState,
    engine: ChatEngine,
    turn: Turn,
    prep: Prepared,
    answers: Sequence[Answer],
    then: Callable[[list[Committed]], None] | None = None,
) -> list[Committed | None]:
    """Observe the turn in the metrics and, in a session, commit each choice as a version (all
    or nothing, `commit_alternatives`): the first where the turn attaches, every other as a
    sibling on a branch of its own, so each alternative can be continued. `then` runs in the
    same worker thread right after the commit (a Responses record, say).

    The commit is the point of no return: once it has started, a client that goes away (which
    cancels the request) no longer stops it; the request waits for it and answers as usual, so
    that "nothing was committed" is only ever said when it is true."""
    fins = [a.fin for a in answers]
    observe(state, prep, fins)
    if turn.target is None:
        return [None] * len(answers)
    target = turn.target
    choices = [
        (
            np.asarray([*prep.prompt_ids, *a.fin.output_ids], dtype=TOKEN_DTYPE),
            [*turn.messages, a.stored_as(turn.answer_item_id)],
        )
        for a in answers
    ]

    def commit_all() -> list[Committed]:
        done = commit_alternatives(
            state.store.versions, turn.user, target, choices, engine.fingerprint, turn.epoch, prep.seen
        )
        if then is not None:
            then(done)
        return done

    work = asyncio.ensure_future(asyncio.to_thread(commit_all))
    try:
        committed = await asyncio.shield(work)
    except asyncio.CancelledError:
        committed = await work  # finish the commit, then answer as if nobody had gone
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
    state.metrics.commits.inc(len(committed))
    maybe_check(state, engine, turn, prep)
    return list(committed)


def observe(state: AppState, prep: Prepared, fins: Sequence[Finished]) -> None:
    info = dss_info(prep, fins)
    m = state.metrics
    m.observe_prompt(len(prep.prompt_ids), info.engine_cached_tokens, info.loaded_from.model_dump())
    if prep.lead is not None:
        m.observe_lead(prep.lead.served, prep.lead.reason, prep.lead.update_tokens)
    m.completion_tokens.inc(sum(len(f.output_ids) for f in fins))
    ttfts = [f.ttft_s for f in fins if f.ttft_s is not None]
    if ttfts:
        m.ttft_seconds.observe(min(ttfts))
    errors = sum(f.report.store_errors for f in fins if f.report is not None)
    if errors:
        m.store_errors.inc(errors)
