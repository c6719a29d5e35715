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
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from api.errors import BadRequest, EngineOverloaded, EngineUnavailable, UncachedModel
from api.settings import Settings
from dss.errors import ErasedDuringGeneration, InvalidInput
from dss.store import Store
from dss.types import FingerprintId, TenantId
from dss.wire import SessionTag, TurnReport, tag_key

log = logging.getLogger("dss.api.engine")

_ERASED = "the user was erased during this answer; nothing of it was kept"


@dataclass(frozen=True, slots=True)
class Sampling:
    """A request's generation parameters, converted once by vLLM's own request model
    (`ChatEngine.sampling`), so that every honoured field has vLLM's semantics."""

    max_tokens: int
    n: int
    params: Any  # vllm.SamplingParams, without DSS's extra args (added per generation)
    logprobs: int | None  # top log-probabilities asked for per token (0: the sampled one only)
    tools: tuple[dict[str, Any], ...] = ()  # tools the answer may call (parsed when a parser is set)
    parse_tools: bool = False
    request: Any = None  # vLLM's ChatCompletionRequest, which its tool parsers read


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
        default_sampling: Mapping[str, Any] | None = None,
        tool_call_parser: str | None = None,
    ) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.fingerprint = fingerprint
        self._tag_key = tag_key  # signs the session tags the connector acts on
        # The model's generation defaults (its generation_config), as vLLM's own server uses them.
        self.default_sampling = dict(default_sampling or {})
        self.tool_call_parser = tool_call_parser
        self.created = int(time.time())
        # Accepted in a request's `model`: the served name, "default", or the model folder.
        self.model_names = {model_name, "default"}
        self._admission = _Admission(max_inflight, retry_after_s)
        self.on_inflight_change: Any = None  # set by the app: a gauge setter
        # Generations running per tenant, so that erasing a user stops theirs (one event loop:
        # no lock needed).
        self._running: dict[TenantId, set[str]] = {}
        self._aborted: set[str] = set()
        # Why DSS does not cache this engine's KV (served as plain vLLM); None: caching is on.
        self.uncached_reason: str | None = None
        self.on_caching_change: Any = None  # set by the app: called with kv_caching when it changes

    @property
    def kv_caching(self) -> bool:
        return self.uncached_reason is None

    def note_report(self, report: TurnReport | None) -> None:
        """A turn's report says the connector turned itself off inside the engine (a worker's
        KV cache did not match, the store renamed the fingerprint): from then on the server says
        caching is off, in /readyz and `dss_kv_caching_enabled`, not only in the engine's log."""
        if report is None or not report.caching_off or self.uncached_reason is not None:
            return
        log.error("DSS KV caching is OFF in the engine: %s", report.caching_off)
        self.uncached_reason = report.caching_off
        if self.on_caching_change is not None:
            self.on_caching_change(False)

    # ----------------------------------------------------------------------------------- start/stop
    @classmethod
    async def start(cls, settings: Settings, store: Store) -> ChatEngine:
        """Start the engine against the store's RPC (blocking parts run in a worker thread)."""
        from engine_patch.setup import factory
        from engine_patch.setup.model import resolve_model

        eng = settings.engine
        data_dir = settings.store.resolved_data_dir
        model_path = await asyncio.to_thread(resolve_model, eng.model, data_dir)
        address, authkey = store.serve_rpc()
        known = set(store.fingerprints)
        es = eng.engine_settings(model_path)
        if eng.tool_call_parser is not None:
            _tool_parser_class(eng.tool_call_parser)  # an unknown name fails before the model loads
        uncached: list[str] = []

        def check_caching(vllm_config: Any) -> None:
            # Before any engine process starts: refuse, rather than serve uncached unannounced.
            from engine_patch.connector.fingerprint import uncached_reason

            reason = uncached_reason(vllm_config)
            if reason is None:
                return
            if not eng.allow_uncached:
                raise UncachedModel(
                    f"DSS cannot cache model {Path(model_path).name}: {reason} "
                    "(set DSS_ENGINE__ALLOW_UNCACHED=true to serve it without caching)"
                )
            log.warning("serving model %s WITHOUT KV caching: %s", Path(model_path).name, reason)
            uncached.append(reason)

        llm = await asyncio.to_thread(factory.build_async_engine, address, authkey, es, check_caching)
        try:
            tokenizer = llm.get_tokenizer()
            model_config = llm.model_config
            max_len = int(model_config.max_model_len)
            name = eng.served_model_name or Path(model_path).name
            fid = None if uncached else _engine_fingerprint(factory, llm, store, known)
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
            default_sampling=_generation_defaults(model_config),
            tool_call_parser=eng.tool_call_parser,
        )
        engine.model_names |= {Path(model_path).name, str(model_path)}
        engine.uncached_reason = uncached[0] if uncached else None
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
    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> list[int]:
        """Prompt token ids of `messages` (and `tools`) through the model's chat template."""
        return self.encode(self.render_text(messages, add_generation_prompt, tools))

    def render_text(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                [template_message(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                tools=[dict(t) for t in tools] or None,
            )
        except Exception as exc:  # templates raise plain exceptions for unsupported role orders
            raise InvalidInput(f"the chat template rejected the messages: {exc}") from exc
        return str(text)

    def continue_from(
        self,
        stored: Sequence[int],
        stored_messages: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] = (),
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
            before = self.render_text(stored_messages, add_generation_prompt=False, tools=tools)
        except InvalidInput:
            return None
        after = self.render_text([*stored_messages, *new_messages], add_generation_prompt=True, tools=tools)
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

    def token_text(self, token_id: int) -> str:
        """One token's text as vLLM's server shows it in log-probabilities."""
        return str(self.tokenizer.decode([token_id]))

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

    # ---------------------------------------------------------------------------------- sampling
    def sampling(
        self, messages: Sequence[Mapping[str, Any]], fields: Mapping[str, Any], max_tokens: int
    ) -> Sampling:
        """Convert a request's honoured OpenAI fields (`api.openai_fields`) with vLLM's own request
        model and its conversion to sampling parameters; its validation errors become 400s that
        name the parameter. Tools: `tool_choice: "none"` passes them to the chat template only;
        `"auto"` (the default with tools) needs a tool-call parser, as in vLLM's own server."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChat
        from vllm.exceptions import VLLMClientError

        try:
            req = VllmChat.model_validate({**fields, "messages": [dict(m) for m in messages]})
        except ValidationError as exc:
            raise _validation_error(exc) from None
        except (ValueError, TypeError, VLLMClientError) as exc:  # VLLMValidationError names the parameter
            raise BadRequest(str(exc), param=getattr(exc, "parameter", None)) from None
        tools = tuple(t.model_dump(exclude_none=True) for t in req.tools or ())
        parse_tools = False
        if tools and req.tool_choice != "none":
            if req.tool_choice not in (None, "auto"):
                raise BadRequest(
                    "`tool_choice` naming a function, or `required`, is not served by this server; "
                    'use "auto" (with `dss serve --tool-call-parser`) or "none"',
                    code="unsupported_parameter",
                    param="tool_choice",
                )
            if self.tool_call_parser is None:
                raise BadRequest(
                    '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                    "set (start the server with `dss serve --tool-call-parser NAME`)",
                    code="tool_call_parser_not_configured",
                    param="tool_choice",
                )
            parse_tools = True
            # As vLLM's server: the parser may adjust the request (keep its markers in the text).
            req = _tool_parser_class(self.tool_call_parser)(self.tokenizer).adjust_request(req)
        try:
            params = req.to_sampling_params(max_tokens, dict(self.default_sampling))
        except (ValueError, TypeError, VLLMClientError) as exc:
            raise BadRequest(str(exc), param=getattr(exc, "parameter", None)) from None
        return Sampling(max_tokens, int(params.n), params, params.logprobs, tools, parse_tools, req)

    def tool_calls(self, sampling: Sampling, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The answer's text split by the configured vLLM tool parser into content and tool calls
        (OpenAI's `{"id", "type": "function", "function": {"name", "arguments"}}`)."""
        assert self.tool_call_parser is not None and sampling.parse_tools
        parser = _tool_parser_class(self.tool_call_parser)(self.tokenizer)
        info = parser.extract_tool_calls(text, sampling.request)
        if not info.tools_called:
            return text, []
        calls = [c.model_dump(exclude_none=True) for c in info.tool_calls]
        if sampling.request.parallel_tool_calls is False:
            calls = calls[:1]  # as vLLM's server: one call when parallel calls are off
        for call in calls:
            call.setdefault("id", "call_" + uuid.uuid4().hex[:24])
            call.setdefault("type", "function")
        return info.content or None, calls

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
        sid = session_id if session_id is not None else f"anon-{uuid.uuid4().hex}"
        params = sampling.params.clone()
        params.output_kind = RequestOutputKind.DELTA
        params.extra_args = (
            SessionTag(tenant, sid, state_version).extra_args(self._tag_key) if persist else None
        )
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids), cache_salt=cache_salt)
        request_id = "chatcmpl-" + uuid.uuid4().hex
        self._running.setdefault(tenant, set()).add(request_id)
        choices = [_ChoiceState() for _ in range(sampling.n)]
        finished: list[Finished] = []
        aborted = False
        try:
            # aclosing: a consumer that stops early (client gone) aborts the request at once.
            async with contextlib.aclosing(self.llm.generate(prompt, params, request_id)) as outputs:
                async for out in outputs:
                    for comp in out.outputs:
                        st = choices[comp.index]
                        if out.num_cached_tokens is not None:
                            st.cached = int(out.num_cached_tokens)
                        if out.kv_transfer_params:
                            st.report = TurnReport.from_params(out.kv_transfer_params)
                            self.note_report(st.report)
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
            raise EngineOverloaded(exc.message, self._admission.retry_after_s) from exc
        except VLLMClientError as exc:
            param = getattr(exc, "parameter", None)
            raise BadRequest(str(exc), code="invalid_generation_request", param=param) from exc
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            if request_id in self._aborted:
                raise ErasedDuringGeneration(_ERASED) from exc
            if getattr(self.llm, "errored", False):
                raise EngineUnavailable("the engine died; the server needs a restart") from exc
            raise
        finally:
            running = self._running.get(tenant)
            if running is not None:
                running.discard(request_id)
                if not running:
                    del self._running[tenant]
            aborted = request_id in self._aborted
            self._aborted.discard(request_id)  # however the generation ended: no id is kept
        if aborted:
            raise ErasedDuringGeneration(_ERASED)
        for fin in finished:
            reported = fin.report.fingerprint if fin.report is not None else None
            if reported and reported != self.fingerprint:
                log.warning(
                    "the connector writes pages under fingerprint %s, not %s; following it",
                    reported,
                    self.fingerprint,
                )
                self.fingerprint = FingerprintId(str(reported))


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


def _validation_error(exc: Any) -> BadRequest:
    """A 400 from vLLM's request model's first validation error, naming its parameter."""
    err = exc.errors()[0] if exc.errors() else {}
    cause = (err.get("ctx") or {}).get("error")
    param = getattr(cause, "parameter", None)
    if param is None:
        loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
        param = loc[0] if loc else None
    message = str(cause) if cause is not None else str(err.get("msg", "invalid request"))
    return BadRequest(message, param=param)


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as vLLM gives it to a chat template: tool-call arguments (JSON text in OpenAI's
    API) as objects, so that a template's `tojson` writes them once."""
    out = dict(message)
    calls = out.get("tool_calls")
    if calls:
        decoded = []
        for call in calls:
            fn = dict(call.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                with contextlib.suppress(ValueError):
                    fn["arguments"] = json.loads(fn["arguments"])
            decoded.append({**call, "function": fn})
        out["tool_calls"] = decoded
    return out


def _tool_parser_class(name: str) -> Any:
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(sorted(ToolParserManager.list_registered()))
        raise ValueError(f"unknown tool-call parser {name!r} (known: {known})") from None


def _generation_defaults(model_config: Any) -> dict[str, Any]:
    try:
        return dict(model_config.get_diff_sampling_param())
    except Exception:  # a model without a generation config
        return {}


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


def _engine_fingerprint(
    factory: Any, llm: Any, store: Store, known_before: set[FingerprintId]
) -> FingerprintId | None:
    """The model fingerprint the engine's connector writes pages under, registered in the store.

    The connector registers the same id from the engine process and reports it with every
    session request's result (`TurnReport.fingerprint`), which `generate` checks.
    """
    try:
        from engine_patch.connector.fingerprint import (
            GroupsKnownInEngine,
            frontend_fingerprint,
            registered_for_model,
        )

        try:
            return store.fingerprints.register(frontend_fingerprint(llm.vllm_config))
        except GroupsKnownInEngine:
            # A sliding-window model: the engine's connector registered its fingerprint.
            known = [store.fingerprints.get(f) for f in store.fingerprints]
            found = registered_for_model(llm.vllm_config, known)
            if len(found) == 1:
                return found[0].id
    except Exception as exc:  # a config the connector cannot describe: it is off as well
        log.warning("cannot compute the engine's model fingerprint here (%s); guessing from the store", exc)
    fresh = [f for f in store.fingerprints if f not in known_before]
    return fresh[0] if len(fresh) == 1 else None
