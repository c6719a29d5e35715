"""The embedded vLLM engine as the chat routes see it.

`ChatEngine` wraps vLLM's `AsyncLLM`: it renders chat messages with the tokenizer's chat template
into prompt token ids (the server, not vLLM, owns the prompt, because those ids are what a
version stores), runs generations with the session's KV-transfer parameters (tenant derived on
the server) and the tenant's prefix-cache salt, measures time to first token, and admits a
bounded number of generations at once: beyond it the caller gets `EngineOverloaded` (503 with
Retry-After) instead of an unbounded queue.

vLLM is imported here only, and only when the engine starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.errors import BadRequest, EngineOverloaded, EngineUnavailable
from api.settings import Settings
from dss.errors import ErasedDuringGeneration, InvalidInput
from dss.store import Store
from dss.types import FingerprintId, TenantId
from dss.wire import SessionTag, TurnReport, tag_key

log = logging.getLogger("dss.api.engine")

_ERASED = "the user was erased during this answer; nothing of it was kept"


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


@dataclass(frozen=True, slots=True)
class Delta:
    """New text of a running generation."""

    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    """The end of a generation: everything a commit and a response need."""

    text: str
    output_ids: tuple[int, ...]
    finish_reason: str | None
    num_cached_tokens: int  # engine prefix cache + connector loads, as vLLM reports it
    report: TurnReport | None  # what the connector did for the request (None: not a session request)
    ttft_s: float | None


@dataclass
class _Admission:
    limit: int
    retry_after_s: int
    inflight: int = 0


@dataclass(eq=False)
class Slot:
    """A generation slot taken by `ChatEngine.admit` for one request; `release` gives it back
    (once, however often it is called)."""

    engine: ChatEngine
    adopted: bool = False  # a generation of the request runs in it (`ChatEngine.admitted`)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.engine._release()


# The slot of the request being answered: set by `admit` in the route, read by the generation
# that follows in the same request, also from the task a streaming response runs its body in
# (tasks start with a copy of their creator's context).
_HELD: contextvars.ContextVar[Slot | None] = contextvars.ContextVar("dss_admission_slot", default=None)


class ChatEngine:
    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        *,
        model_name: str,
        max_model_len: int,
        fingerprint: FingerprintId | None,
        max_inflight: int,
        retry_after_s: int,
        tag_key: bytes,
    ) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.fingerprint = fingerprint
        self._tag_key = tag_key  # signs the session tags the connector acts on
        self.created = int(time.time())
        # Accepted in a request's `model`: the served name, "default", or the model folder.
        self.model_names = {model_name, "default"}
        self._admission = _Admission(max_inflight, retry_after_s)
        self.on_inflight_change: Any = None  # set by the app: a gauge setter
        # Generations running per tenant, so that erasing a user stops theirs (one event loop:
        # no lock needed).
        self._running: dict[TenantId, set[str]] = {}
        self._aborted: set[str] = set()

    # ----------------------------------------------------------------------------------- start/stop
    @classmethod
    async def start(cls, settings: Settings, store: Store) -> ChatEngine:
        """Start the engine against the store's RPC (blocking parts run in a worker thread)."""
        from engine_patch import factory
        from engine_patch.model import resolve_model

        eng = settings.engine
        data_dir = settings.store.resolved_data_dir
        model_path = await asyncio.to_thread(resolve_model, eng.model, data_dir)
        address, authkey = store.serve_rpc()
        known = set(store.fingerprints)
        es = _engine_settings(factory, settings, model_path)
        llm = await asyncio.to_thread(factory.build_async_engine, address, authkey, es)
        try:
            tokenizer = llm.get_tokenizer()
            model_config = llm.model_config
            max_len = int(model_config.max_model_len)
            name = eng.served_model_name or Path(model_path).name
            fid = _engine_fingerprint(factory, llm, store, known)
        except BaseException:
            llm.shutdown()
            raise
        if eng.nice > 0:
            _lower_engine_priority(eng.nice)
        log.info("engine ready: model %s, context %d tokens, fingerprint %s", name, max_len, fid)
        engine = cls(
            llm,
            tokenizer,
            model_name=name,
            max_model_len=max_len,
            fingerprint=fid,
            max_inflight=eng.max_inflight,
            retry_after_s=eng.retry_after_s,
            tag_key=tag_key(authkey),
        )
        engine.model_names |= {Path(model_path).name, str(model_path)}
        return engine

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.shutdown()

    async def ready(self) -> bool:
        try:
            await self.llm.check_health()
        except Exception:
            return False
        return not getattr(self.llm, "errored", False)

    # ------------------------------------------------------------------------------------ prompts
    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids of `messages` through the model's chat template."""
        return self.encode(self.render_text(messages, add_generation_prompt))

    def render_text(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # templates raise plain exceptions for unsupported role orders
            raise InvalidInput(f"the chat template rejected the messages: {exc}") from exc
        return str(text)

    def continue_from(
        self,
        stored: Sequence[int],
        stored_messages: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
    ) -> list[int] | None:
        """The prompt of a turn that extends a version: the version's stored token ids exactly
        (its prompt and its answer as generated, end token included), then the template's text
        for the new messages, tokenized. None when the stored ids are not the start of what the
        template writes for the version's messages (a stop string cut the answer's text short
        of its tokens, say); the caller then renders the whole dialogue.

        Generated ids do not always survive a round trip through text ("A|im|ing" comes back as
        "Aiming"), so a prompt re-rendered from the messages can differ from the stored tokens
        early in the answer, and every page from there on would be recomputed. Where the ids do
        round-trip, the result equals `render(stored_messages + new_messages)`.
        """
        try:
            # A template may refuse a dialogue that ends on an answer: render it whole instead.
            before = self.render_text(stored_messages, add_generation_prompt=False)
        except InvalidInput:
            return None
        after = self.render_text([*stored_messages, *new_messages], add_generation_prompt=True)
        if not after.startswith(before):
            return None  # a template that rewrites earlier turns when one is added
        as_stored = self.decode(stored)
        if not before.startswith(as_stored):
            return None
        # What the template writes after the stored ids: the rest of the closing of the answer
        # (the newline after its end token, or the end token itself for an answer cut by
        # max_tokens), then the new messages and the generation prompt.
        return [*stored, *self.encode(before[len(as_stored) :] + after[len(before) :])]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids exactly as the tokenizer has them, special tokens included."""
        return str(
            self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )

    def encode(self, text: str) -> list[int]:
        # The template already wrote the special tokens it wants.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_length(self, n_prompt: int, max_tokens: int | None, default_max: int) -> int:
        """The max_tokens to use; 400 with the numbers when the prompt does not fit the context."""
        room = self.max_model_len - n_prompt
        if max_tokens is None:
            if room < 1:
                raise BadRequest(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                    f"messages resulted in {n_prompt} tokens.",
                    code="context_length_exceeded",
                    param="messages",
                )
            return min(default_max, room)
        if n_prompt + max_tokens > self.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the messages, {max_tokens} in "
                "the completion).",
                code="context_length_exceeded",
                param="messages",
            )
        return max_tokens

    # --------------------------------------------------------------------------------- admission
    def admit(self) -> Slot:
        """Take a generation slot for the request being answered, now, or fail with
        `EngineOverloaded` (503, Retry-After). Counted from here on, before the response starts:
        a stream counted only once its body began let a whole burst past the limit. The request's
        generation (in this context) then uses this slot: `check_capacity` passes, `admitted`
        adopts it and gives it back when the generation ends; the caller releases it as well
        (idempotent), for the requests that end before they generate."""
        self._check_free()
        slot = Slot(self)
        self._admission.inflight += 1  # one event loop: no lock between the check and the increment
        self._report_inflight()
        _HELD.set(slot)
        return slot

    def check_capacity(self) -> None:
        """Fail fast with `EngineOverloaded` when every generation slot is taken (a request that
        holds one from `admit` passes)."""
        if self._held() is None:
            self._check_free()

    def _check_free(self) -> None:
        adm = self._admission
        if adm.inflight >= adm.limit:
            raise EngineOverloaded(
                f"{adm.inflight} generations are running, the limit is {adm.limit}; retry shortly",
                adm.retry_after_s,
            )

    def _held(self) -> Slot | None:
        slot = _HELD.get()
        return slot if slot is not None and slot.engine is self and not slot.released else None

    def _release(self) -> None:
        self._admission.inflight -= 1
        self._report_inflight()

    @contextlib.asynccontextmanager
    async def admitted(self, strict: bool = True) -> AsyncIterator[None]:
        """Hold a generation slot: the one this request took with `admit`, else a new one.
        `strict`: fail with `EngineOverloaded` when none is free; otherwise take it anyway (a
        stream whose capacity was checked before its 200 went out)."""
        held = self._held()
        if held is not None and not held.adopted:
            held.adopted = True
            try:
                yield
            finally:
                held.release()
            return
        adm = self._admission
        if strict:
            self._check_free()
        adm.inflight += 1  # one event loop: no lock needed between the check and the increment
        self._report_inflight()
        try:
            yield
        finally:
            self._release()

    async def abort_tenant(self, tenant: TenantId) -> int:
        """Stop every generation of `tenant` (its user is being erased): each ends with
        `ErasedDuringGeneration`, so no version of it is committed. Returns how many."""
        ids = list(self._running.get(tenant, ()))
        if ids:
            self._aborted.update(ids)
            await self.llm.abort(ids)
        return len(ids)

    def _report_inflight(self) -> None:
        if self.on_inflight_change is not None:
            self.on_inflight_change(self._admission.inflight)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: Sampling,
        *,
        tenant: TenantId,
        cache_salt: str,
        session_id: str | None,
        state_version: int | None,
        arrived: float,
    ) -> AsyncGenerator[Delta | Finished, None]:
        """Stream the generation: `Delta`s as text arrives, then one `Finished`.

        Cancelling the iteration aborts the request in the engine (vLLM does it on cancellation).
        """
        from vllm import SamplingParams, TokensPrompt
        from vllm.exceptions import GracefulHTTPError, VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        # The connector acts only on requests that name a session; a plain chat gets a one-off
        # id so that it is still cached in (and served from) the user's namespace.
        sid = session_id if session_id is not None else f"anon-{uuid.uuid4().hex}"
        extra = SessionTag(tenant, sid, state_version).extra_args(self._tag_key)
        params = SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=1.0 if sampling.temperature is None else sampling.temperature,
            top_p=1.0 if sampling.top_p is None else sampling.top_p,
            stop=list(sampling.stop) or None,
            seed=sampling.seed,
            presence_penalty=sampling.presence_penalty or 0.0,
            frequency_penalty=sampling.frequency_penalty or 0.0,
            output_kind=RequestOutputKind.DELTA,
            extra_args=extra,
        )
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids), cache_salt=cache_salt)
        request_id = "chatcmpl-" + uuid.uuid4().hex
        self._running.setdefault(tenant, set()).add(request_id)
        text_parts: list[str] = []
        output_ids: list[int] = []
        ttft: float | None = None
        cached = 0
        report: TurnReport | None = None
        finish_reason: str | None = None
        try:
            # aclosing: a consumer that stops early (client gone) aborts the request at once.
            async with contextlib.aclosing(self.llm.generate(prompt, params, request_id)) as outputs:
                async for out in outputs:
                    if out.num_cached_tokens is not None:
                        cached = int(out.num_cached_tokens)
                    if out.kv_transfer_params:
                        report = TurnReport.from_params(out.kv_transfer_params)
                    for comp in out.outputs:
                        if comp.token_ids and ttft is None:
                            ttft = time.perf_counter() - arrived
                        output_ids.extend(comp.token_ids)
                        if comp.finish_reason is not None:
                            finish_reason = comp.finish_reason
                        if comp.text:
                            text_parts.append(comp.text)
                            yield Delta(comp.text)
        except GracefulHTTPError as exc:
            raise EngineOverloaded(exc.message, self._admission.retry_after_s) from exc
        except VLLMClientError as exc:
            raise BadRequest(str(exc), code="invalid_generation_request") from exc
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            if request_id in self._aborted:
                raise ErasedDuringGeneration(
                    "the user was erased during this answer; nothing was kept"
                ) from exc
            if getattr(self.llm, "errored", False):
                raise EngineUnavailable("the engine died; the server needs a restart") from exc
            raise
        finally:
            running = self._running.get(tenant)
            if running is not None:
                running.discard(request_id)
                if not running:
                    del self._running[tenant]
        if request_id in self._aborted:
            self._aborted.discard(request_id)
            raise ErasedDuringGeneration(_ERASED)
        reported = report.fingerprint if report is not None else None
        if reported and reported != self.fingerprint:
            log.warning(
                "the connector writes pages under fingerprint %s, not %s; following it",
                reported,
                self.fingerprint,
            )
            self.fingerprint = FingerprintId(str(reported))
        yield Finished("".join(text_parts), tuple(output_ids), finish_reason, cached, report, ttft)


def _lower_engine_priority(nice: int) -> None:
    """Run the engine's processes at a higher nice value than the API process.

    The engine computes for long stretches on every core it gets; the API answers in a few
    milliseconds of CPU. With equal priority a rollback waits behind the engine's time slices
    (tens of milliseconds on a 2-core machine); with the engine niced, the kernel runs the API's
    short bursts at once and the engine loses only what the API actually uses. Linux keeps a
    nice value per thread, so every thread of every engine process is reniced (threads created
    later inherit it from their creator).
    """
    try:
        import psutil
    except ImportError:
        return
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            for thread in child.threads():
                with contextlib.suppress(OSError):
                    if os.getpriority(os.PRIO_PROCESS, thread.id) < nice:
                        os.setpriority(os.PRIO_PROCESS, thread.id, nice)


def _engine_settings(factory: Any, settings: Settings, model_path: Path) -> Any:
    eng = settings.engine
    kwargs: dict[str, Any] = {
        "model": Path(model_path),
        "kv_cache_space_gib": eng.kv_cache_space_gib,
        "enforce_eager": eng.enforce_eager,
        "seed": eng.seed,
    }
    if eng.max_model_len is not None:
        kwargs["max_model_len"] = eng.max_model_len
    if eng.max_num_seqs is not None:
        kwargs["max_num_seqs"] = eng.max_num_seqs
    if eng.dtype is not None:
        kwargs["dtype"] = eng.dtype
    if eng.served_model_name is not None:
        kwargs["served_model_name"] = eng.served_model_name
    fields = getattr(factory.EngineSettings, "__dataclass_fields__", None)
    if fields is not None:
        kwargs = {k: v for k, v in kwargs.items() if k in fields}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(eng.kv_cache_space_gib))
    return factory.EngineSettings(**kwargs)


def _engine_fingerprint(
    factory: Any, llm: Any, store: Store, known_before: set[FingerprintId]
) -> FingerprintId | None:
    """The model fingerprint the engine's connector writes pages under, registered in the store.

    The connector registers the same id from the engine process and reports it with every
    session request's result (`TurnReport.fingerprint`), which `generate` checks.
    """
    try:
        from engine_patch.fingerprint import frontend_fingerprint

        return store.register_fingerprint(frontend_fingerprint(llm.vllm_config))
    except Exception as exc:  # a config the connector cannot describe: it is off as well
        log.warning("cannot compute the engine's model fingerprint here (%s); guessing from the store", exc)
    fresh = [f for f in store.fingerprints if f not in known_before]
    return fresh[0] if len(fresh) == 1 else None
