"""Response bodies checked against the protocols' own published types: the openai SDK's `ChatCompletion`
and `Response`, the anthropic SDK's `Message` (both pinned in the `test` extra).

The SDK models are validated strictly (pydantic's strict mode: no coercion of strings to numbers or the
like; an int still passes for a float). They take fields they do not know without complaint, so what
these tests catch is a missing required field or a value outside a field's type or literals.
"""

import copy
import json
import os

import pydantic
import pytest
from anthropic.types import Message
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from dsjax.batch.bodies import complete_body
from dsjax.batch.job import JobConfig, run_job
from dsjax.batch.jobfile import InputLine
from dsjax.batch.recipe import Recipe
from dsjax.run_config import RunConfig
from dsjax.embedded import MODEL_DIR

CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
TYPES = {CHAT: ChatCompletion, RESPONSES: Response, MESSAGES: Message}
M = "DeepSeek-V4.1-Flash"
FN = {"name": "get_weather", "description": "Weather of a city",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_TOOLS = [{"type": "function", "function": FN}]
RESPONSES_TOOLS = [{"type": "function", **FN}]
MESSAGES_TOOLS = [{"name": FN["name"], "description": FN["description"], "input_schema": FN["parameters"]}]
ASK = "Write the function `dedent` from the `textwrap` module."
WEATHER = "Weather in Paris?"


def validate(endpoint: str, body: dict):
    return TYPES[endpoint].model_validate(body, strict=True)


def added_paths(before, after, at=()) -> set[tuple]:
    """The paths of the keys that `after` has and `before` lacks (dicts only)."""
    out = set()
    if isinstance(before, dict) and isinstance(after, dict):
        for k, v in after.items():
            out |= {at + (k,)} if k not in before else added_paths(before[k], v, at + (k,))
    return out


def check(endpoint: str, body: dict):
    """Validate `body` as dsjax writes it and completed; returns the SDK model of the completed body.

    The body as written may fail only for fields that `complete_body` adds (while the job does not
    call it yet); once the job completes its bodies itself, `complete_body` changes nothing and the
    body as written validates as it is."""
    completed = complete_body(endpoint, body)
    assert complete_body(endpoint, completed) == completed
    added = added_paths(body, completed)
    try:
        validate(endpoint, body)
    except pydantic.ValidationError as e:
        errors = [(tuple(err["loc"]), err["type"]) for err in e.errors()]
        assert errors and all(loc in added and kind == "missing" for loc, kind in errors), errors
    return validate(endpoint, completed)


# ---- complete_body on hand-made bodies -----------------------------------------------------------

def responses_body(usage="default") -> dict:
    body = {"id": "resp_1", "object": "response", "created_at": 1700000000, "status": "completed",
            "model": M, "output": [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                                    "content": [{"type": "output_text", "text": "Hi", "annotations": []}]}],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}
    if usage == "default":
        usage = {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 6}
    if usage != "absent":
        body["usage"] = usage
    return body


CHAT_BODY = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": M,
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "logprobs": None,
                          "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                       "prompt_tokens_details": {"cached_tokens": 0}}}
MESSAGES_BODY = {"id": "msg_1", "type": "message", "role": "assistant", "model": M,
                 "content": [{"type": "text", "text": "Hi"}], "stop_reason": "end_turn", "stop_sequence": None,
                 "usage": {"input_tokens": 5, "output_tokens": 1, "cache_creation_input_tokens": 0,
                           "cache_read_input_tokens": 0}}


def test_responses_usage_gets_cache_write_tokens():
    body = responses_body()
    kept = copy.deepcopy(body)
    with pytest.raises(pydantic.ValidationError, match="cache_write_tokens"):
        validate(RESPONSES, body)
    completed = complete_body(RESPONSES, body)
    assert body == kept  # not changed in place
    assert completed["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    assert added_paths(body, completed) == {("usage", "input_tokens_details", "cache_write_tokens")}
    assert validate(RESPONSES, completed).usage.input_tokens_details.cache_write_tokens == 0  # a field it knows
    assert complete_body(RESPONSES, completed) == completed  # idempotent


def test_complete_body_keeps_what_is_there():
    body = responses_body()
    body["usage"]["input_tokens_details"]["cache_write_tokens"] = 3
    assert complete_body(RESPONSES, body) is body
    assert complete_body(RESPONSES, body)["usage"]["input_tokens_details"]["cache_write_tokens"] == 3


@pytest.mark.parametrize("usage", [None, "absent", {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6}])
def test_complete_body_invents_no_usage(usage):
    """An absent or null usage (or usage details) is no place to count cache writes in."""
    body = responses_body(usage)
    assert complete_body(RESPONSES, body) == responses_body(usage)


@pytest.mark.parametrize("endpoint, body", [(CHAT, CHAT_BODY), (MESSAGES, MESSAGES_BODY)])
def test_chat_and_messages_bodies_need_nothing(endpoint, body):
    validate(endpoint, body)
    assert complete_body(endpoint, body) is body
    assert body == (CHAT_BODY if endpoint == CHAT else MESSAGES_BODY)


def test_unknown_endpoint():
    with pytest.raises(ValueError, match="/v1/completions"):
        complete_body("/v1/completions", {})


# ---- tool calls: tokens the tiny model does not write, scripted through the recipe ------------------

CALL = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">'
        'Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
EOS = 1  # the embedded model's <｜end▁of▁sentence｜>
THOUGHT = "need a tool</think>Checking.\n\n"
SCRIPTED = [
    (CHAT, {"messages": [{"role": "user", "content": WEATHER}], "tools": CHAT_TOOLS, "max_tokens": 200,
            "logprobs": True, "top_logprobs": 2}, THOUGHT),
    (CHAT, {"messages": [{"role": "user", "content": WEATHER}], "tools": CHAT_TOOLS, "max_tokens": 200,
            "thinking": {"type": "disabled"}}, ""),
    (RESPONSES, {"input": WEATHER, "tools": RESPONSES_TOOLS, "max_output_tokens": 200}, THOUGHT),
    (RESPONSES, {"input": WEATHER, "tools": RESPONSES_TOOLS, "max_output_tokens": 200,
                 "reasoning": {"effort": "none"}}, ""),
    (MESSAGES, {"messages": [{"role": "user", "content": WEATHER}], "tools": MESSAGES_TOOLS, "max_tokens": 200},
     THOUGHT),
    (MESSAGES, {"messages": [{"role": "user", "content": WEATHER}], "tools": MESSAGES_TOOLS, "max_tokens": 200,
                "thinking": {"type": "disabled"}}, ""),
]


@pytest.mark.parametrize("endpoint, body, before", SCRIPTED,
                         ids=[f"{e.rsplit('/', 1)[1]}-{'thinking' if t else 'plain'}" for e, _, t in SCRIPTED])
def test_tool_call_bodies(endpoint, body, before):
    recipe = Recipe(os.path.join(MODEL_DIR, "tokenizer.json"), 4096, (EOS,), prompt_format="v4.1", served_names=(M,))
    prep = recipe.prepare(InputLine(1, "call", endpoint, {"model": M, **body}))
    stream = recipe.stream(prep)
    for token in recipe.tokenizer.encode(before + CALL):
        top = None if prep.sampling.logprobs is None else [(token, -0.25), (EOS, -2.0)]
        assert not stream.token(token, -0.25, top)
    model = check(endpoint, stream.finish("stop"))  # the engine saw EOS
    if endpoint == CHAT:
        (choice,) = model.choices
        assert choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
            [("get_weather", {"city": "Paris"})]
    elif endpoint == RESPONSES:
        assert model.status == "completed"
        calls = [o for o in model.output if o.type == "function_call"]
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    else:
        assert model.stop_reason == "tool_use"
        assert [(c.name, c.input) for c in model.content if c.type == "tool_use"] == \
            [("get_weather", {"city": "Paris"})]


# ---- the job on the embedded model: every body it writes ------------------------------------------

def line(cid, url, **body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": M, **body}}


def user(text):
    return [{"role": "user", "content": text}]


REQUESTS = [
    line("chat-thinking", CHAT, messages=user(ASK), max_tokens=16, thinking={"type": "enabled"}),
    line("chat-plain", CHAT, messages=[{"role": "system", "content": "Be brief."}] + user(ASK), max_tokens=12,
         thinking={"type": "disabled"}),
    line("chat-logprobs", CHAT, messages=user(ASK), max_tokens=6, logprobs=True, top_logprobs=3,
         thinking={"type": "disabled"}, temperature=0),
    line("chat-logprobs-thinking", CHAT, messages=user(ASK), max_tokens=6, logprobs=True,
         thinking={"type": "enabled"}),
    line("chat-tools", CHAT, messages=user(WEATHER), tools=CHAT_TOOLS, tool_choice="auto", max_tokens=12),
    line("chat-tools-none", CHAT, messages=user(WEATHER), tools=CHAT_TOOLS, tool_choice="none", max_tokens=8,
         thinking={"type": "disabled"}),
    line("chat-stop", CHAT, messages=user(ASK), max_tokens=24, stop=["\n", "zz"], thinking={"type": "disabled"},
         temperature=0),
    line("chat-length", CHAT, messages=user(ASK), max_tokens=1),
    line("responses-string", RESPONSES, input=ASK, max_output_tokens=16),
    line("responses-instructions", RESPONSES, input=user(ASK), instructions="Be brief.", max_output_tokens=12,
         reasoning={"effort": "high"}),
    line("responses-no-reasoning", RESPONSES, input=ASK, max_output_tokens=8, reasoning={"effort": "none"},
         top_logprobs=2, include=["message.output_text.logprobs"]),
    line("responses-tools", RESPONSES, input=WEATHER, tools=RESPONSES_TOOLS, tool_choice="auto",
         max_output_tokens=12),
    line("responses-small", RESPONSES, input=ASK, max_output_tokens=1),
    line("messages-system", MESSAGES, system="Be brief.", messages=user(ASK), max_tokens=16),
    line("messages-thinking", MESSAGES, messages=user(ASK), max_tokens=16,
         thinking={"type": "enabled", "budget_tokens": 1024}),
    line("messages-stop", MESSAGES, messages=user(ASK), max_tokens=24, stop_sequences=["\n"],
         thinking={"type": "disabled"}, temperature=0),
    line("messages-tools", MESSAGES, messages=user(WEATHER), tools=MESSAGES_TOOLS, tool_choice={"type": "auto"},
         max_tokens=12, thinking={"type": "disabled"}),
]


@pytest.mark.heavy
def test_job_bodies_validate_with_the_sdks(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    summary = run_job(JobConfig(model=MODEL_DIR, input=str(inp), output=str(out), progress=False,
                                run=RunConfig(slots=8, max_len=512, chunk_size=128, dtype="float32")))
    assert summary["requests_ok"] == len(REQUESTS)
    urls = {r["custom_id"]: r["url"] for r in REQUESTS}
    records = [json.loads(raw) for raw in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in records) == sorted(urls)
    models = {}
    for record in records:
        assert record["error"] is None, record
        url = urls[record["custom_id"]]
        models[record["custom_id"]] = model = check(url, record["response"]["body"])
        assert model.model == M
    # the shapes the requests were written for
    assert models["chat-stop"].choices[0].finish_reason == "stop"
    assert models["chat-length"].choices[0].finish_reason == "length"
    assert models["chat-logprobs"].choices[0].logprobs.content[0].top_logprobs
    assert models["responses-small"].status == "incomplete"
    assert models["responses-small"].incomplete_details.reason == "max_output_tokens"
    assert models["responses-no-reasoning"].output[0].content[0].logprobs
    assert models["messages-stop"].stop_reason == "stop_sequence"
    assert models["messages-stop"].stop_sequence == "\n"
    assert models["messages-thinking"].content[0].type == "thinking"
