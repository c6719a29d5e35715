"""Tools and the request-field policy with the default model's real tokenizer and vLLM's own request
model and tool parsers (no engine: conversion and parsing only)."""

from __future__ import annotations

import json

import pytest

from api.http_errors import BadRequest
from api.llm.chat_engine import ChatEngine, template_message
from api.shapes.openai_fields import HONOURED_CHAT, REFUSED, check_fields
from dss.types import FingerprintId
from tests.api_server import model_dir

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def make_engine(parser: str | None) -> ChatEngine:
    path = model_dir()
    if path is None:
        pytest.skip("the default model is not prepared (make model)")
    from transformers import AutoTokenizer

    return ChatEngine(
        None,
        AutoTokenizer.from_pretrained(str(path)),
        model_name="m",
        max_model_len=4096,
        fingerprint=FingerprintId("fp"),
        max_inflight=1,
        retry_after_s=1,
        tag_key=b"k" * 32,
        tool_call_parser=parser,
    )


def test_tools_without_a_parser_are_refused_as_vllm_refuses_them() -> None:
    engine = make_engine(None)
    for fields in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        with pytest.raises(BadRequest) as err:
            engine.sampling(ASK, fields, 16)
        assert err.value.code == "tool_call_parser_not_configured" and err.value.param == "tool_choice"
        assert "--tool-call-parser" in err.value.message
    # "none": the tools go to the chat template only, nothing is parsed.
    s = engine.sampling(ASK, {"tools": [WEATHER], "tool_choice": "none"}, 16)
    assert not s.parse_tools and s.tools[0]["function"]["name"] == "get_weather"
    # A named function or "required" is not served (vLLM would force JSON arguments): a 400.
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        with pytest.raises(BadRequest) as err:
            engine.sampling(ASK, {"tools": [WEATHER], "tool_choice": choice}, 16)
        assert err.value.param == "tool_choice" and err.value.code == "unsupported_parameter"
    # vLLM's own validation errors keep their parameter.
    with pytest.raises(BadRequest) as err:
        engine.sampling(ASK, {"tools": []}, 16)
    assert err.value.param == "tools"


def test_a_configured_parser_splits_tool_calls_from_the_answer() -> None:
    engine = make_engine("hermes")
    s = engine.sampling(ASK, {"tools": [WEATHER]}, 16)
    assert s.parse_tools
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = engine.tool_calls(s, text)
    assert content is None and len(calls) == 1
    call = calls[0]
    assert call["type"] == "function" and call["id"].startswith(("call_", "chatcmpl-tool-"))
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # Plain text stays content.
    assert engine.tool_calls(s, "It is sunny.") == ("It is sunny.", [])
    # The parser adjusted the request as in vLLM's server (hermes keeps its markers in the text).
    assert s.params.skip_special_tokens is False
    # parallel_tool_calls: false keeps the first call only, as vLLM does.
    two = text + "\n" + text.replace("Paris", "Rome")
    assert len(engine.tool_calls(s, two)[1]) == 2
    one = engine.sampling(ASK, {"tools": [WEATHER], "parallel_tool_calls": False}, 16)
    assert [json.loads(c["function"]["arguments"]) for c in engine.tool_calls(one, two)[1]] == [
        {"city": "Paris"}
    ]
    # An answer's tool calls go back to the template with their arguments decoded, as vLLM's.
    echoed = template_message({"role": "assistant", "content": "", "tool_calls": [call]})
    assert echoed["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert call["function"]["arguments"] == '{"city": "Paris"}'  # the caller's message is not changed
    # The tools reach the chat template (this model's ignores them; the call must not fail).
    assert engine.render(ASK, tools=s.tools) == engine.render(ASK)


def test_every_field_is_honoured_or_refused_by_name() -> None:
    check_fields({"temperature": 0.5, "logprobs": True, "top_k": 3}, own=())
    check_fields({"echo": False, "store": False, "add_generation_prompt": True}, own=())  # no-ops pass
    for name, value in (("echo", True), ("cache_salt", "x"), ("kv_transfer_params", {"a": 1})):
        with pytest.raises(BadRequest) as err:
            check_fields({name: value}, own=())
        assert err.value.param == name and err.value.code == "unsupported_parameter"
    with pytest.raises(BadRequest) as err:
        check_fields({"frobnicate": 1}, own=())
    assert err.value.code == "unrecognized_parameter" and "frobnicate" in err.value.message
    assert not set(HONOURED_CHAT) & set(REFUSED)


def test_every_field_of_vllms_chat_request_is_classified() -> None:
    """A field vLLM adds in an upgrade is refused as unrecognised until it is listed; this test
    names the ones vLLM has now, so an upgrade that adds one shows up here."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    own_or_ours = {"session_id"}  # vLLM has a `session_id` too; DSS's own takes the name
    unclassified = set(ChatCompletionRequest.model_fields) - HONOURED_CHAT - set(REFUSED) - own_or_ours
    assert unclassified == set(), unclassified
