"""A request's generation parameters, with vLLM's semantics: its request model validates the
request's honoured OpenAI fields once (`validate_request`), then converts them to sampling
parameters once the prompt's length fixes `max_tokens` (`sampling_for`). Tools: the configured
vLLM tool-call parser splits an answer into content and tool calls (`tool_calls`).

vLLM is imported only inside these functions, when a request arrives.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from api.http_errors import BadRequest


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    """A request as vLLM's own request model validated it, before `max_tokens` is known."""

    request: Any  # vLLM's ChatCompletionRequest, which its tool parsers read
    tools: tuple[dict[str, Any], ...]  # tools the answer may call, as the chat template gets them
    parse_tools: bool  # the answer is parsed for tool calls (`tool_choice` "auto" with a parser)


@dataclass(frozen=True, slots=True)
class Sampling:
    """A request's generation parameters, converted by vLLM's own request model, so that every
    honoured field has vLLM's semantics."""

    max_tokens: int
    n: int
    params: Any  # vllm.SamplingParams, without DSS's extra args (added per generation)
    logprobs: int | None  # top log-probabilities asked for per token (0: the sampled one only)
    tools: tuple[dict[str, Any], ...] = ()  # tools the answer may call (parsed when a parser is set)
    parse_tools: bool = False
    request: Any = None  # vLLM's ChatCompletionRequest, which its tool parsers read


def validate_request(
    messages: Sequence[Mapping[str, Any]],
    fields: Mapping[str, Any],
    tokenizer: Any,
    tool_call_parser: str | None,
) -> ValidatedRequest:
    """Validate a request's honoured OpenAI fields (`api.shapes.openai_fields`) with vLLM's request
    model; its validation errors become 400s that name the parameter. Tools: `tool_choice: "none"`
    passes them to the chat template only; `"auto"` (the default with tools) needs a tool-call
    parser, as in vLLM's own server."""
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
        if tool_call_parser is None:
            raise BadRequest(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                "set (start the server with `dss serve --tool-call-parser NAME`)",
                code="tool_call_parser_not_configured",
                param="tool_choice",
            )
        parse_tools = True
        # As vLLM's server: the parser may adjust the request (keep its markers in the text).
        req = tool_parser_class(tool_call_parser)(tokenizer).adjust_request(req)
    return ValidatedRequest(req, tools, parse_tools)


def sampling_for(validated: ValidatedRequest, max_tokens: int, defaults: Mapping[str, Any]) -> Sampling:
    """The sampling parameters of a validated request, `max_tokens` fixed (vLLM's conversion;
    `defaults`: the model's generation config, as vLLM's own server uses it)."""
    from vllm.exceptions import VLLMClientError

    req = validated.request
    try:
        params = req.to_sampling_params(max_tokens, dict(defaults))
    except (ValueError, TypeError, VLLMClientError) as exc:
        raise BadRequest(str(exc), param=getattr(exc, "parameter", None)) from None
    return Sampling(
        max_tokens, int(params.n), params, params.logprobs, validated.tools, validated.parse_tools, req
    )


def tool_calls(
    sampling: Sampling, text: str, tokenizer: Any, tool_call_parser: str
) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer's text split by the configured vLLM tool parser into content and tool calls
    (OpenAI's `{"id", "type": "function", "function": {"name", "arguments"}}`)."""
    assert sampling.parse_tools
    parser = tool_parser_class(tool_call_parser)(tokenizer)
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


def tool_parser_class(name: str) -> Any:
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(sorted(ToolParserManager.list_registered()))
        raise ValueError(f"unknown tool-call parser {name!r} (known: {known})") from None


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
