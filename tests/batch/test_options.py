"""Every request option either works or is refused by name: the tables of what dsjax carries out."""

import pytest

from dsjax.batch.options import unenforced_constraint, unsupported_option

CHAT, RESP, MSG = "/v1/chat/completions", "/v1/responses", "/v1/messages"


@pytest.mark.parametrize("url, body", [
    (CHAT, {"model": "m", "messages": [], "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["x"], "max_tokens": 5,
            "logprobs": True, "top_logprobs": 2, "user": "u", "metadata": {"a": "b"}, "store": False, "n": 1,
            "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "stream": False,
            "parallel_tool_calls": True, "response_format": {"type": "text"}, "service_tier": "auto",
            "reasoning_effort": "high", "thinking": {"type": "enabled"}, "max_completion_tokens": 4}),
    (CHAT, {"model": "m", "messages": [], "frequency_penalty": None, "logit_bias": None, "top_k": None}),
    (RESP, {"model": "m", "input": "hi", "instructions": "i", "max_output_tokens": 4, "reasoning": {"effort": "low"},
            "text": {"format": {"type": "text"}, "verbosity": "medium"}, "truncation": "disabled",
            "include": ["reasoning.encrypted_content"], "store": True, "background": False, "top_logprobs": 1}),
    (MSG, {"model": "m", "messages": [], "max_tokens": 3, "system": "s", "stop_sequences": ["x"], "metadata": {},
           "tool_choice": {"type": "auto"}, "thinking": {"type": "disabled"}, "stream": False,
           "tools": [{"name": "f", "input_schema": {"type": "object"}}]}),
    (RESP, {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                    {"type": "function_call_output", "call_id": "c", "output": "ok"}],
            "tools": [{"type": "function", "name": "f", "parameters": {}}], "reasoning": {"effort": "high"}}),
])
def test_options_that_work_pass(url, body):
    assert unsupported_option(url, body) is None


@pytest.mark.parametrize("url, key, value, says", [
    (CHAT, "response_format", {"type": "grammar", "grammar": "x"}, "not one dsjax enforces"),
    (CHAT, "logit_bias", {"5": 1}, "logit bias"),
    (CHAT, "frequency_penalty", 0.5, "frequency penalty"),
    (CHAT, "presence_penalty", -1, "presence penalty"),
    (CHAT, "frequency_penalty", False, "frequency penalty"),
    (CHAT, "stream", True, "whole responses"),
    (CHAT, "parallel_tool_calls", False, "one tool call"),
    (CHAT, "top_k", 5, "not supported by dsjax"),
    (CHAT, "min_p", 0.1, "not supported by dsjax"),
    (CHAT, "functions", [], "not supported by dsjax"),
    (RESP, "text", {"format": {"type": "lark", "lark": "start: x"}}, "text.format"),
    (RESP, "text", {"verbosity": "low"}, "verbosity"),
    (RESP, "previous_response_id", "resp_1", "stored responses"),
    (RESP, "truncation", "auto", "drop input"),
    (RESP, "include", ["file_search_call.results"], "file_search_call.results"),
    (RESP, "max_tool_calls", 2, "number of tool calls"),
    (RESP, "seed", 1, "not supported by dsjax"),
    (MSG, "top_k", 40, "top-k"),
    (MSG, "tool_choice", {"type": "auto", "disable_parallel_tool_use": True}, "one tool call"),
    (CHAT, "max_completion_tokens", 0, "positive integer"),
    (CHAT, "max_tokens", True, "positive integer"),
    (RESP, "max_output_tokens", -3, "positive integer"),
    (MSG, "max_tokens", 2.5, "positive integer"),
    (RESP, "tools", [{"type": "web_search"}], "hosted tool"),
    (MSG, "tools", [{"type": "web_search_20250305", "name": "web_search"}], "hosted tool"),
    (RESP, "reasoning", {"effort": "high", "summary": "auto"}, "reasoning.summary"),
    (RESP, "input", [{"type": "bogus"}], "'bogus'"),
    (RESP, "input", [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "'input_file'"),
    (MSG, "messages", [{"role": "user", "content": [{"type": "document", "source": {}}]}], "'document'"),
    (CHAT, "messages", [{"role": "user", "content": [{"type": "file", "file": {}}]}], "'file'"),
    (CHAT, "messages", [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "'input_audio'"),
])
def test_options_that_would_be_ignored_are_refused_by_name(url, key, value, says):
    err = unsupported_option(url, {"model": "m", key: value})
    assert err is not None and err.code == "unsupported_parameter"
    assert repr(key) in err.message and says in err.message


def test_a_tool_choice_without_tools_is_refused():
    for url, choice in ((CHAT, "required"), (RESP, "required"),
                        (CHAT, {"type": "function", "function": {"name": "f"}})):
        err = unsupported_option(url, {"model": "m", "tool_choice": choice})
        assert err.code == "unsupported_parameter" and "declares no tools" in err.message
    assert unsupported_option(CHAT, {"model": "m", "tool_choice": "none"}) is None
    assert unsupported_option(MSG, {"model": "m", "tool_choice": {"type": "auto"}}) is None


def test_output_formats_and_tool_calls_pass_and_an_unknown_constraint_is_refused():
    for kind in (None, "tool_call", "tool_call_required", "json", "regex"):
        assert unenforced_constraint(kind) is None
    err = unenforced_constraint("grammar")
    assert err.code == "unsupported_parameter" and "'grammar'" in err.message
    for url, body in ((CHAT, {"response_format": {"type": "json_object"}}),
                      (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}),
                      (CHAT, {"response_format": {"type": "regex", "regex": "a+"}}),
                      (CHAT, {"response_format": {"type": "ebnf", "ebnf": 'root ::= "a"'}}),
                      (RESP, {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}),
                      (RESP, {"text": {"format": {"type": "regex", "regex": "a+"}}}),
                      (MSG, {"output_format": {"type": "json_schema", "schema": {}}}),
                      (MSG, {"output_config": {"format": {"type": "json_schema", "schema": {}}}})):
        assert unsupported_option(url, {"model": "m", **body}) is None, body
