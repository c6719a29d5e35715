"""The embedded vLLM engine as a turn sees it: `ChatEngine`.

`ChatEngine` wraps vLLM's `AsyncLLM` and its tokenizer: it renders chat messages with the
tokenizer's chat template into prompt token ids (the server, not vLLM, owns the prompt, because
those ids are what a version stores), continues a version from its stored ids
(`dss.dialogue.continuation`), fixes `max_tokens` against the context, validates requests with
vLLM's request model (`api.llm.sampling`), and holds what the generations share: the generation
slots (`api.llm.slots`), the generations running per tenant (`api.llm.tenant_aborts`), the key
that signs session tags, the model fingerprint, and the store's load planner (`LoadPlanner`).
Generating is `api.llm.generation`; starting the engine is `api.llm.startup`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from api.http_errors import BadRequest
from api.llm.sampling import Sampling, ValidatedRequest, sampling_for, tool_calls, validate_request
from api.llm.slots import GenerationSlots
from api.llm.tenant_aborts import TenantAborts
from dss.dialogue.continuation import continuation_text
from dss.errors import InvalidInput
from dss.types import FingerprintId, TenantId
from dss.wire import PlannedLoad, TurnReport

log = logging.getLogger("dss.api.llm")


class LoadPlanner(Protocol):
    """What plans a session request's load before it is sent (`dss.ops.kv.KVCache`)."""

    def plan_ahead(
        self, fid: FingerprintId, tenant: TenantId, tokens: Sequence[int]
    ) -> PlannedLoad | None: ...

    def drop_planned(self, planned: PlannedLoad) -> None: ...


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
        slots_per_user: int | None = None,
        default_sampling: Mapping[str, Any] | None = None,
        tool_call_parser: str | None = None,
        planner: LoadPlanner | None = None,
    ) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.fingerprint = fingerprint
        self.session_tag_key = tag_key  # signs the session tags the connector acts on
        self.planner = planner  # plans a session request's load before it is sent (None: the engine asks)
        # The model's generation defaults (its generation_config), as vLLM's own server uses them.
        self.default_sampling = dict(default_sampling or {})
        self.tool_call_parser = tool_call_parser
        self.created = int(time.time())
        # Accepted in a request's `model`: the served name, "default", or the model folder.
        self.model_names = {model_name, "default"}
        self.slots = GenerationSlots(max_inflight, retry_after_s, slots_per_user)
        self.tenant_aborts = TenantAborts()
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

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.shutdown()

    async def ready(self) -> bool:
        try:
            await self.llm.check_health()
        except Exception:
            return False
        return not getattr(self.llm, "errored", False)

    async def abort_tenant(self, tenant: TenantId) -> int:
        """Stop every generation of `tenant` (its user is being erased): each ends with
        `ErasedDuringGeneration`, so no version of it is committed. Returns how many."""
        return await self.tenant_aborts.abort_tenant(self.llm, tenant)

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
        """The prompt of a turn that extends a version: the continuation rule of
        `dss.dialogue.continuation` (the version's stored ids, then the template's text for the
        new messages) over this model's template and tokenizer. None: render the whole dialogue."""
        try:
            # A template may refuse a dialogue that ends on an answer: render it whole instead.
            before = self.render_text(stored_messages, add_generation_prompt=False, tools=tools)
        except InvalidInput:
            return None
        after = self.render_text([*stored_messages, *new_messages], add_generation_prompt=True, tools=tools)
        if not after.startswith(before):
            return None  # a template that rewrites earlier turns when one is added: no decode needed
        rest = continuation_text(self.decode(stored), before, after)
        return None if rest is None else [*stored, *self.encode(rest)]

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

    # ---------------------------------------------------------------------------------- requests
    def validate(self, messages: Sequence[Mapping[str, Any]], fields: Mapping[str, Any]) -> ValidatedRequest:
        """The request validated by vLLM's request model, once (`api.llm.sampling`)."""
        return validate_request(messages, fields, self.tokenizer, self.tool_call_parser)

    def sampling_for(self, validated: ValidatedRequest, max_tokens: int) -> Sampling:
        return sampling_for(validated, max_tokens, self.default_sampling)

    def sampling(
        self, messages: Sequence[Mapping[str, Any]], fields: Mapping[str, Any], max_tokens: int
    ) -> Sampling:
        """Validate and convert in one step (where `max_tokens` is known beforehand)."""
        return self.sampling_for(self.validate(messages, fields), max_tokens)

    def tool_calls(self, sampling: Sampling, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The answer's text split by the configured vLLM tool parser into content and tool calls."""
        assert self.tool_call_parser is not None
        return tool_calls(sampling, text, self.tokenizer, self.tool_call_parser)


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
