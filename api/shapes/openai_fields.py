"""Which request fields of the OpenAI Chat Completions API (and vLLM's extensions of it) this server
honours, and which it refuses: nothing a client sends is silently dropped.

A field is one of four kinds:
- DSS's own (`session_id`, `state_version`, ...): read by the route, never passed to vLLM;
- honoured: passed to vLLM's own request model, whose conversion to sampling parameters decides
  what it does (so a field gets vLLM's semantics, and its validation errors, with each upgrade);
- refused: a known field whose effect this server cannot give (the server owns the prompt and the
  KV cache), answered with a 400 that names it, unless its value is the no-op default;
- unrecognised: anything else, answered with a 400 that names it, as OpenAI does.

A field that vLLM adds in a later release is unrecognised here until it is listed: refusing it
is safe, ignoring it would not be.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from api.http_errors import BadRequest

# Passed to vLLM's `ChatCompletionRequest` as given.
HONOURED_CHAT: frozenset[str] = frozenset(
    {
        "messages",
        "model",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "n",
        "response_format",
        "structured_outputs",
        "seed",
        "stop",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "user",
        "allowed_token_ids",
        "bad_words",
        "skip_special_tokens",
        "spaces_between_special_tokens",
    }
)

# Known fields this server does not honour, with the reason a client is told. A value equal to
# the field's default (`False`, `None`, `[]`, ...) asks for nothing and passes.
REFUSED: Mapping[str, str] = {
    "echo": "the server owns the prompt",
    "add_generation_prompt": "the server owns the prompt",
    "continue_final_message": "the server owns the prompt",
    "add_special_tokens": "the server owns the prompt",
    "chat_template": "the server renders prompts with the model's own chat template",
    "chat_template_kwargs": "the server renders prompts with the model's own chat template",
    "documents": "the model's chat template takes no documents",
    "cache_salt": "the prefix-cache salt is derived on the server from the user",
    "kv_transfer_params": "KV transfer is decided on the server",
    "ec_transfer_params": "encoder-cache transfer is decided on the server",
    "vllm_xargs": "engine extra arguments are set on the server",
    "request_id": "request ids are made on the server",
    "priority": "this server schedules first come, first served",
    "prompt_logprobs": "prompt log-probabilities are not returned by this server",
    "logprob_token_ids": "only the sampled and top log-probabilities are returned",
    "return_tokens_as_token_ids": "tokens are returned as text",
    "return_token_ids": "token ids are not returned by this server",
    "return_token_offsets": "token offsets are not returned by this server",
    "return_prompt_text": "prompt text is not returned by this server",
    "return_mm_kwargs": "the model is text-only",
    "mm_processor_kwargs": "the model is text-only",
    "media_io_kwargs": "the model is text-only",
    "mm_payload": "the model is text-only",
    "modalities": "the model is text-only",
    "audio": "the model is text-only",
    "use_beam_search": "beam search is not served",
    "length_penalty": "beam search is not served",
    "truncate_prompt_tokens": "a prompt is never truncated: a dialogue's history is its state",
    "truncation_side": "a prompt is never truncated: a dialogue's history is its state",
    "routed_experts_prompt_start": "the model has no experts",
    "reasoning_effort": "the model does not reason",
    "thinking_token_budget": "the model does not reason",
    "include_reasoning": "the model does not reason",
    "repetition_detection": "not served",
    "stream_interval": "streams send every new token",
    "watermarking": "not served",
    "prediction": "predicted outputs are not served",
    "service_tier": "this server has one tier",
    "store": "use session_id (or the Responses API) to store a dialogue",
    "metadata": "use session metadata (POST /v1/sessions)",
    "web_search_options": "this server has no web search",
    "functions": "deprecated: use tools",
    "function_call": "deprecated: use tool_choice",
    "verbosity": "not served",
    "prompt_cache_key": "use session_id: every turn of a session is cached",
}

# Values that ask for nothing (the field's no-op default).
_NO_OP_VALUES: Mapping[str, tuple[Any, ...]] = {
    "include_reasoning": (True, None),
    "add_generation_prompt": (True, None),
    "add_special_tokens": (False, None),
    "length_penalty": (1.0, None),
    "store": (False, None),
    "modalities": (["text"], None),
    "service_tier": ("auto", "default", None),
    "routed_experts_prompt_start": (0, None),
}
_EMPTY: tuple[Any, ...] = (None, False, [], {}, "")


def check_fields(
    fields: Mapping[str, Any],
    own: Iterable[str],
    honoured: frozenset[str] = HONOURED_CHAT,
    refused: Mapping[str, str] = REFUSED,
    no_op: Mapping[str, tuple[Any, ...]] = _NO_OP_VALUES,
) -> None:
    """400 naming the first field that is neither the route's own (`own`) nor honoured: refused
    ones with the reason (unless at a no-op value), unrecognised ones as OpenAI words it."""
    mine = set(own)
    for name, value in fields.items():
        if name in mine or name in honoured:
            continue
        if name in refused:
            if value in no_op.get(name, _EMPTY):
                continue
            raise BadRequest(
                f"`{name}` is not supported by this server: {refused[name]}",
                code="unsupported_parameter",
                param=name,
            )
        raise BadRequest(
            f"Unrecognized request argument supplied: {name}", code="unrecognized_parameter", param=name
        )
