"""The output formats of the three protocols: those the recipe reads stay in the body, dsjax's own are taken out."""

import json

import pytest

from dsjax.batch.formats import FormatError, asks_for_format, recipe_constraint, split

CHAT, RESP, MSG = "/v1/chat/completions", "/v1/responses", "/v1/messages"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("url, body", [
    (CHAT, {"response_format": {"type": "json_object"}}),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}),
    (CHAT, {"response_format": {"type": "regex", "regex": "a+"}}),
    (RESP, {"text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}}),
    (CHAT, {}), (MSG, {}), (RESP, {"text": {"verbosity": "medium"}}),
])
def test_formats_the_recipe_reads_stay(url, body):
    assert split(url, {"model": "m", **body}) == ({"model": "m", **body}, None)


@pytest.mark.parametrize("url, body, rest, found", [
    (CHAT, {"response_format": {"type": "ebnf", "ebnf": 'root ::= "a"'}}, {}, ("ebnf", 'root ::= "a"')),
    (RESP, {"text": {"format": {"type": "regex", "regex": "a+"}, "verbosity": "medium"}},
     {"text": {"verbosity": "medium"}}, ("regex", "a+")),
    (RESP, {"text": {"format": {"type": "ebnf", "ebnf": 'root ::= "a"', "name": "g"}}}, {}, ("ebnf", 'root ::= "a"')),
    (MSG, {"output_format": {"type": "json_schema", "schema": SCHEMA}}, {}, ("json_schema", json.dumps(SCHEMA))),
    (MSG, {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}, {},
     ("json_schema", json.dumps(SCHEMA))),
    (MSG, {"output_config": {}}, {}, None),
])
def test_dsjax_formats_are_taken_out(url, body, rest, found):
    assert split(url, {"model": "m", **body}) == ({"model": "m", **rest}, found)
    assert asks_for_format(url, {"model": "m", **body}) or found is None


@pytest.mark.parametrize("url, body, says", [
    (CHAT, {"response_format": {"type": "ebnf"}}, "response_format.ebnf"),
    (CHAT, {"response_format": {"type": "ebnf", "ebnf": " "}}, "non-empty string"),
    (CHAT, {"response_format": {"type": "ebnf", "grammar": "x"}}, "response_format.grammar is not a field"),
    (RESP, {"text": {"format": {"type": "regex", "regex": 5}}}, "text.format.regex"),
    (MSG, {"output_format": {"type": "json_schema", "schema": SCHEMA}, "output_config": {"format": {}}}, "not both"),
    (MSG, {"output_config": {"effort": "low"}}, "output_config.effort"),
    (MSG, {"output_config": "json"}, "must be an object"),
    (MSG, {"output_format": {"type": "json_object"}}, "'json_schema'"),
    (MSG, {"output_format": {"type": "json_schema"}}, "schema must be a JSON schema object"),
    (MSG, {"output_format": {"type": "json_schema", "schema": SCHEMA, "strict": True}}, "strict is not a field"),
])
def test_wrong_formats_are_named(url, body, says):
    with pytest.raises(FormatError, match=says):
        split(url, {"model": "m", **body})


def test_the_prescan_sees_every_format_and_only_formats():
    assert asks_for_format(CHAT, {"response_format": {"type": "json_object"}})
    assert asks_for_format(RESP, {"text": {"format": {"type": "json_schema"}}})
    assert asks_for_format(MSG, {"output_format": {}})
    assert not asks_for_format(CHAT, {"response_format": {"type": "text"}})
    assert not asks_for_format(RESP, {"text": {"format": {"type": "text"}}})
    assert not asks_for_format(MSG, {"messages": []}) and not asks_for_format(CHAT, ["not", "a", "body"])
    # strict tools and required tool calls are constrained too
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert not asks_for_format(CHAT, {"tools": [tool], "tool_choice": "auto"})
    assert asks_for_format(CHAT, {"tools": [tool], "tool_choice": "required"})
    assert asks_for_format(CHAT, {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert asks_for_format(CHAT, {"tools": [{**tool, "function": {**tool["function"], "strict": True}}]})
    assert asks_for_format(RESP, {"tools": [{"type": "function", "name": "f", "strict": True}]})
    assert asks_for_format(MSG, {"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "any"}})
    assert not asks_for_format(MSG, {"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "auto"}})


def test_the_recipes_constraints_become_grammars():
    assert recipe_constraint("json", "") == ("json_schema", '{"type": "object"}')
    assert recipe_constraint("json", '{"type":"array"}') == ("json_schema", '{"type":"array"}')
    assert recipe_constraint("regex", "a+") == ("regex", "a+")
    assert recipe_constraint("tool_call_required", "[]") == ("tool_calls", "[]")
    with pytest.raises(ValueError, match="'grammar'"):
        recipe_constraint("grammar", "x")
