"""One generation in vLLM as a stream of `Delta`s and `Finished`s.

The request runs with the session's KV-transfer parameters (a tag signed for the tenant derived
on the server, which the connector acts on) and the tenant's prefix-cache salt; each choice
measures its time to first token. vLLM's errors become DSS's: overload (503), a request vLLM
refuses (400), an erasure during the answer, a dead engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from api.http_errors import BadRequest, EngineOverloaded, EngineUnavailable
from api.llm.sampling import Sampling
from dss.errors import DSSError, ErasedDuringGeneration
from dss.types import FingerprintId, SessionId, TenantId
from dss.wire import PlannedLoad, SessionTag, TurnReport

if TYPE_CHECKING:
    from api.llm.chat_engine import ChatEngine

log = logging.getLogger("dss.api.llm")

_ERASED = "the user was erased during this answer; nothing of it was kept"


@dataclass(frozen=True, slots=True)
class Delta:
    """New output of one choice of a running generation."""

    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[Any, ...] | None = None  # per token: vLLM's {token id: Logprob}, when asked for


@dataclass(frozen=True, slots=True)
class Finished:
    """The end of one choice of a generation: everything a commit and a response need."""

    index: int
    text: str
    output_ids: tuple[int, ...]
    finish_reason: str | None
    num_cached_tokens: int  # engine prefix cache + connector loads, as vLLM reports it
    report: TurnReport | None  # what the connector did for the request (None: not a session request)
    ttft_s: float | None
    logprobs: tuple[Any, ...] | None = None  # per output token, when asked for
    stop_reason: int | str | None = None


async def generate(
    engine: ChatEngine,
    prompt_ids: Sequence[int],
    sampling: Sampling,
    *,
    tenant: TenantId,
    cache_salt: str,
    session_id: SessionId | None,
    arrived: float,
    persist: bool = True,
) -> AsyncGenerator[Delta | Finished, None]:
    """Stream the generation: `Delta`s as each choice's text arrives, and a `Finished` as each
    of the `sampling.n` choices ends. The prompt is one request to vLLM, which computes its KV
    once for every choice. A consumer commits only after the iteration ended: an erasure
    during the generation raises at its end, after the choices finished.

    Cancelling the iteration aborts the request in the engine (vLLM does it on cancellation).
    `persist=False`: the request carries no session tag, so the connector neither loads nor
    saves its KV (only the engine's own, volatile prefix cache sees it).
    """
    from vllm import TokensPrompt
    from vllm.exceptions import GracefulHTTPError, VLLMClientError
    from vllm.sampling_params import RequestOutputKind

    # The connector acts only on requests that name a session; a plain chat gets a one-off
    # id so that it is still cached in (and served from) the user's namespace.
    sid = session_id if session_id is not None else SessionId(f"anon-{uuid.uuid4().hex}")
    params = sampling.params.clone()
    params.output_kind = RequestOutputKind.DELTA
    prompt = TokensPrompt(prompt_token_ids=list(prompt_ids), cache_salt=cache_salt)
    request_id = "chatcmpl-" + uuid.uuid4().hex
    aborts = engine.tenant_aborts
    aborts.begin(tenant, request_id)
    choices = [_ChoiceState() for _ in range(sampling.n)]
    finished: list[Finished] = []
    aborted = False
    # One request per prompt (n choices are n engine requests, each needing its own lease). The
    # last step before the request goes: every way out from here ends the plan's lease.
    planned = _plan_load(engine, tenant, prompt_ids) if persist and sampling.n == 1 else None
    tag = SessionTag(tenant, sid)
    params.extra_args = tag.extra_args(engine.session_tag_key, planned) if persist else None
    try:
        # aclosing: a consumer that stops early (client gone) aborts the request at once.
        async with contextlib.aclosing(engine.llm.generate(prompt, params, request_id)) as outputs:
            async for out in outputs:
                if planned is not None:
                    # The engine's workers copied the planned pages before this first token:
                    # the lease is the sender's to end, and it ends now.
                    _drop_planned(engine, planned)
                    planned = None
                for comp in out.outputs:
                    st = choices[comp.index]
                    if out.num_cached_tokens is not None:
                        st.cached = int(out.num_cached_tokens)
                    if out.kv_transfer_params:
                        st.report = TurnReport.from_params(out.kv_transfer_params)
                        engine.note_report(st.report)
                    if st.ttft is None and comp.token_ids:
                        st.ttft = time.perf_counter() - arrived
                    ids = tuple(comp.token_ids)
                    st.output_ids.extend(ids)
                    step_logprobs = tuple(comp.logprobs) if comp.logprobs is not None else None
                    if step_logprobs is not None:
                        st.logprobs.extend(step_logprobs)
                    if comp.text or ids:
                        st.text.append(comp.text)
                        yield Delta(comp.index, comp.text, ids, step_logprobs)
                    if comp.finish_reason is not None and not st.done:
                        st.done = True
                        fin = st.finish(comp.index, comp.finish_reason, comp.stop_reason, sampling)
                        finished.append(fin)
                        yield fin
    except GracefulHTTPError as exc:
        raise EngineOverloaded(exc.message, engine.slots.retry_after_s) from exc
    except VLLMClientError as exc:
        param = getattr(exc, "parameter", None)
        raise BadRequest(str(exc), code="invalid_generation_request", param=param) from exc
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as exc:
        if aborts.was_aborted(request_id):
            raise ErasedDuringGeneration(_ERASED) from exc
        if getattr(engine.llm, "errored", False):
            raise EngineUnavailable("the engine died; the server needs a restart") from exc
        raise
    finally:
        aborted = aborts.end(tenant, request_id)
        if planned is not None:
            # No token came: the engine may never have had the request, or stopped it. Its
            # workers may still copy from the lease (an aborted request's load in flight): the
            # slots' generations tell them if the pages moved on once it ended.
            _drop_planned(engine, planned)
    if aborted:
        raise ErasedDuringGeneration(_ERASED)
    for fin in finished:
        reported = fin.report.fingerprint if fin.report is not None else None
        if reported and reported != engine.fingerprint:
            log.warning(
                "the connector writes pages under fingerprint %s, not %s; following it",
                reported,
                engine.fingerprint,
            )
            engine.fingerprint = FingerprintId(str(reported))


def _drop_planned(engine: ChatEngine, planned: PlannedLoad) -> None:
    """End a planned load's lease (the sender's to end, `PlannedLoad`); a store that cannot is
    logged, and the lease expires."""
    if engine.planner is None:
        return
    try:
        engine.planner.drop_planned(planned)
    except DSSError as exc:
        log.warning("ending a planned load's lease failed; it expires: %s", exc)


def _plan_load(engine: ChatEngine, tenant: TenantId, prompt_ids: Sequence[int]) -> PlannedLoad | None:
    """The request's load, planned by the store beside this process before the request is sent
    (`KVCache.plan_ahead`), so that the engine's scheduler need not ask (issue 31). None when
    there is nothing to load or no planner; a store error leaves the lookup to the engine."""
    if engine.planner is None or engine.fingerprint is None or engine.uncached_reason is not None:
        return None
    try:
        return engine.planner.plan_ahead(engine.fingerprint, tenant, prompt_ids)
    except DSSError as exc:
        log.warning("planning a load before the request failed; the engine looks it up: %s", exc)
        return None


@dataclass
class _ChoiceState:
    text: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    cached: int = 0
    report: TurnReport | None = None
    ttft: float | None = None
    done: bool = False

    def finish(self, index: int, reason: str, stop_reason: int | str | None, sampling: Sampling) -> Finished:
        return Finished(
            index,
            "".join(self.text),
            tuple(self.output_ids),
            reason,
            self.cached,
            self.report,
            self.ttft,
            tuple(self.logprobs) if sampling.logprobs is not None else None,
            stop_reason,
        )
