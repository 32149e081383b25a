"""Tool-call grammars against the recipe's own DSML: its rendering of a call is accepted, wrong calls are not;
and the recipe turns strict tools and required calls into constraints."""

import json
import os

import deepseek_recipe as dr
import pytest

from dsjax.batch.jobfile import InputLine
from dsjax.batch.recipe import Prepared, Recipe
from dsjax.batch.tool_calls import MARKUP, strict_tools, tool_call_grammar
from dsjax.embedded import MODEL_DIR
from dsjax.engine.grammar import Constraint, Grammars

TOKENIZER = os.path.join(MODEL_DIR, "tokenizer.json")
NAMES = {"v4": "DeepSeek-V4-Pro", "v4.1": "DeepSeek-V4.1-Flash"}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
    "units": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "note": {"type": ["string", "null"]},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"}},
    "code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["city", "days", "units", "note", "tags", "code"], "additionalProperties": False}
NOOP = {"type": "object", "properties": {}, "required": [], "additionalProperties": False}


def tools(strict=True):
    return [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "strict": strict,
                                              "parameters": WEATHER}},
            {"type": "function", "function": {"name": "noop", "strict": strict, "parameters": NOOP}}]


ARGS = {"city": "Rome </b> & <i>", "days": 3, "units": "celsius", "note": None, "tags": ["sea", "sun"], "code": "FCO"}


@pytest.fixture(scope="module")
def grammars():
    return Grammars(open(TOKENIZER, encoding="utf-8").read(), 8192 + 64, [1])


@pytest.fixture(scope="module")
def tokenizer():
    return dr.Tokenizer.from_file(TOKENIZER)


def dsml(tokenizer):
    (token,) = tokenizer.encode(dr.SpecialToken.Dsml.default_str())
    return token


def rendered_block(fmt, grammars, calls):
    """The recipe's own rendering of an assistant turn's tool calls, from its first `｜DSML｜` on."""
    recipe = Recipe(TOKENIZER, 8192, (1,), prompt_format=fmt, served_names=(NAMES[fmt],))
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                   for i, (n, a) in enumerate(calls)]},
               *({"role": "tool", "tool_call_id": f"c{i}", "content": "done"} for i in range(len(calls)))]
    prep = recipe.prepare(InputLine(1, "a", "/v1/chat/completions", {
        "model": NAMES[fmt], "messages": history, "tools": tools(), "thinking": {"type": "disabled"}}))
    assert isinstance(prep, Prepared), prep
    text = grammars.tokenizer.decode_str(prep.prompt)
    word = dr.SpecialToken.Dsml.default_str() + MARKUP[fmt][0] + ">"
    end = text.rindex("</" + word) + len("</" + word)  # the system prompt's instructions show the markup too
    return text[text.rindex("<" + word + "\n", 0, end):end]


def follow(grammars, tokenizer, constraint, text):
    """Feed `text`'s tokens to a matcher of `constraint`: (every token accepted, complete at the end)."""
    m = grammars.matcher(constraint)
    for t in tokenizer.encode(text):
        m.consume(t)
        if m.error is not None:
            return False, False
    return True, m.accepting


@pytest.mark.parametrize("fmt", ["v4", "v4.1"])
def test_the_recipes_rendering_of_calls_is_accepted_and_wrong_calls_are_not(fmt, grammars, tokenizer):
    d = dsml(tokenizer)
    block = rendered_block(fmt, grammars, [("get_weather", ARGS), ("noop", {})])
    opening = "<" + dr.SpecialToken.Dsml.default_str() + MARKUP[fmt][0] + ">\n"  # a required call's prompt ends so
    assert block.startswith(opening)
    required = Constraint("lark", tool_call_grammar(json.dumps(tools()), d, True, fmt))
    optional = Constraint("lark", tool_call_grammar(json.dumps(tools()), d, False, fmt), after=d, optional=True)
    assert follow(grammars, tokenizer, required, block[len(opening):]) == (True, True)
    assert follow(grammars, tokenizer, optional, "Let me check.\n\n" + block) == (True, True)
    assert follow(grammars, tokenizer, optional, "No tool needed: it is sunny.") == (True, True)
    assert follow(grammars, tokenizer, required, "It is sunny.") == (False, False)  # a required call must come
    assert follow(grammars, tokenizer, required, block[len(opening):-12])[1] is False  # unfinished
    for wrong in ({**ARGS, "days": "3"}, {**ARGS, "units": "kelvin"}, {**ARGS, "tags": ["Sea"]},
                  {**ARGS, "code": "fco"}, {k: v for k, v in ARGS.items() if k != "days"}):
        bad = rendered_block(fmt, grammars, [("get_weather", wrong)])
        assert follow(grammars, tokenizer, required, bad[len(opening):])[0] is False, wrong
    misnamed = block.replace('name="noop"', 'name="nope"')
    assert follow(grammars, tokenizer, required, misnamed[len(opening):])[0] is False
    # tools that are not strict: the names are held to the list, the parameters are free
    loose = Constraint("lark", tool_call_grammar(json.dumps(tools(strict=False)), d, True, fmt))
    free = rendered_block(fmt, grammars, [("get_weather", {"anything": [1, 2], "city": "x"})])
    assert follow(grammars, tokenizer, loose, free[len(opening):]) == (True, True)
    assert follow(grammars, tokenizer, loose, misnamed[len(opening):])[0] is False


def test_tool_lists_it_cannot_read_are_named():
    assert strict_tools(json.dumps(tools())) and not strict_tools(json.dumps(tools(strict=False)))
    assert not strict_tools("not json")
    for bad, says in (("[", "not JSON"), ("[]", "empty"), ('[{"type": "function"}]', "tool 0")):
        with pytest.raises(ValueError, match=says):
            tool_call_grammar(bad, 5, True)


def recipe(**kw):
    return Recipe(TOKENIZER, 4096, (1,), prompt_format="v4.1", served_names=(NAMES["v4.1"],), **kw)


def request(**body):
    return InputLine(1, "a", "/v1/chat/completions", {"model": NAMES["v4.1"], "max_tokens": 8, "messages": [
        {"role": "user", "content": "Weather in Rome?"}], "thinking": {"type": "disabled"}, **body})


def test_strict_tools_and_required_calls_become_constraints(tokenizer):
    r = recipe()
    d = dsml(tokenizer)
    prep = r.prepare(request(tools=tools(), tool_choice="required"))
    assert isinstance(prep, Prepared) and prep.constraint.kind == "lark" and prep.constraint.after is None
    named = r.prepare(request(tools=tools(), tool_choice={"type": "function", "function": {"name": "noop"}}))
    assert "get_weather" not in named.constraint.text and "noop" in named.constraint.text
    for think in ({"type": "disabled"}, {"type": "enabled"}):
        auto = r.prepare(request(tools=tools(), thinking=think))
        assert auto.constraint.after == d and auto.constraint.optional
    assert r.prepare(request(tools=tools(strict=False))).constraint is None  # optional, loose: nothing to hold
    loose_required = r.prepare(request(tools=tools(strict=False), tool_choice="required"))
    assert loose_required.constraint is not None and "free_param*" in loose_required.constraint.text
    messages = r.prepare(InputLine(1, "a", "/v1/messages", {
        "model": NAMES["v4.1"], "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
        "thinking": {"type": "disabled"}, "tool_choice": {"type": "tool", "name": "noop"},
        "tools": [{"name": "noop", "input_schema": NOOP}]}))
    assert messages.constraint is not None and messages.constraint.after is None
    # the recipe refuses its own formats beside tools; dsjax's extensions are refused here
    assert "should not be used with tools" in r.prepare(request(tools=tools(), response_format={
        "type": "regex", "regex": "a+"})).message
    both = r.prepare(request(tools=tools(), response_format={"type": "ebnf", "ebnf": 'root ::= "a"'}))
    assert both.code == "unsupported_parameter" and "one or the other" in both.message
    refused = recipe(no_formats="not with --speculative dspark").prepare(request(tools=tools(), tool_choice="required"))
    assert refused.code == "unsupported_parameter" and "required tool call" in refused.message
    assert "dspark" in refused.message


@pytest.mark.parametrize("param, says", [({"type": "string", "pattern": "(unclosed"}, "unclosed group"),
                                          ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum (5)")])
def test_a_strict_schema_llguidance_cannot_enforce_is_the_requests_error(param, says):
    bad = tools()
    bad[0]["function"]["parameters"] = {**WEATHER, "properties": {**WEATHER["properties"], "code": param}}
    err = recipe().prepare(request(tools=bad, tool_choice="required"))
    assert not isinstance(err, Prepared) and err.code == "invalid_tool_schema", err
    assert err.message.startswith("tool 'get_weather': parameter 'code' cannot be enforced") and says in err.message


@pytest.mark.heavy
def test_the_embedded_model_makes_valid_calls_when_they_are_required_or_strict(tmp_path):
    """Sampled at temperature 1 on the embedded model: each required call is made, with a known tool and (strict
    tools) arguments that validate against its schema; strict optional calls too, when the model makes one."""
    import jsonschema

    from dsjax.batch.job import JobConfig, run_job
    from dsjax.run_config import RunConfig

    # Every value bounded (a pattern, an enum, a range), so a call always fits max_tokens. The recipe's strict
    # schemas keep patterns, enums and ranges; it drops maxLength, maxItems and const.
    props = {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}, "days": {"type": "integer", "minimum": 1,
             "maximum": 9}, "units": WEATHER["properties"]["units"], "code": WEATHER["properties"]["code"]}
    weather = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    strict = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": weather}},
              {"type": "function", "function": {"name": "noop", "strict": True, "parameters": NOOP}}]
    loose = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    base = {"model": NAMES["v4.1"], "max_tokens": 160, "temperature": 1.0, "messages": [
        {"role": "user", "content": "What is the weather in Rome?"}]}
    items = [{"custom_id": f"{kind}-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {**base, "seed": i, **body}}
             for i in range(4) for kind, body in (
                 ("required", {"tools": strict, "tool_choice": "required", "thinking": {"type": "disabled"}}),
                 ("named", {"tools": strict, "tool_choice": {"type": "function", "function": {"name": "noop"}},
                            "thinking": {"type": "disabled"}}),
                 ("loose", {"tools": loose, "tool_choice": "required", "thinking": {"type": "disabled"}}),
                 ("auto", {"tools": strict}))]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in items))
    summary = run_job(JobConfig(model=MODEL_DIR, input=str(inp), output=str(out), progress=False,
                                run=RunConfig(slots=8, max_len=2048, chunk_size=256, dtype="float32")))
    assert summary["requests_ok"] == len(items) and summary["programs_compiled_during_generation"] == 0
    schemas = {"get_weather": weather, "noop": NOOP}
    for rec in map(json.loads, out.read_text().splitlines()):
        kind = rec["custom_id"].split("-")[0]
        choice = rec["response"]["body"]["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        if kind != "auto":
            assert calls, rec
        if kind in ("required", "named"):  # bounded arguments: the call is complete
            assert choice["finish_reason"] == "tool_calls", rec
        if kind == "named":
            assert {c["function"]["name"] for c in calls} == {"noop"}
        for call in calls:
            assert call["function"]["name"] in schemas
            if kind != "loose":
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
