"""Which request options a batch job carries out: every option either works or gets an error record that
names it, never silently ignored.

deepseek-recipe reads many options that only a hosted API acts on, and accepts sampling options that
dsjax's sampler does not have (penalties, logit bias, top-k). A request that asks for any of them would be
answered as if it had not, so it is refused here, before conversion. Output formats (JSON, JSON schemas,
regexes, EBNF grammars), strict tool arguments and required tool calls are enforced by constrained decoding
(`batch.formats`, `batch.tool_calls`).
"""

from __future__ import annotations

from typing import Any, Callable

from dsjax.batch.jobfile import ErrorInfo

_ANY: Callable[[Any], str | None] = lambda v: None


def _only(*allowed: Any, why: str) -> Callable[[Any], str | None]:
    """A check that accepts the values that mean "off" (`allowed`) and explains anything else."""
    def check(value):
        if any(value == a and type(value) is type(a) for a in allowed):
            return None
        return why
    return check


_FORMATS = ("text", "json_object", "json_schema", "regex", "ebnf")


def _format(value: Any, where: str) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind is None or kind in _FORMATS:
        return None  # the recipe (or `formats.split`) reads it and names what is wrong
    return f"{where} of type {kind!r} is not one dsjax enforces (it enforces {list(_FORMATS)})"


def _text(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None  # the recipe reports the wrong type
    if (why := _format(value.get("format"), "text.format")) is not None:
        return why
    if value.get("verbosity") not in (None, "medium"):
        return "text.verbosity is not supported: the model has no verbosity control; drop it"
    unknown = sorted(set(value) - {"format", "verbosity"})
    return f"text.{unknown[0]} is not supported" if unknown else None


def _include(value: Any) -> str | None:
    known = {"reasoning.encrypted_content", "message.output_text.logprobs"}
    if isinstance(value, list):
        bad = [v for v in value if v not in known]
        if bad:
            return f"include {bad[0]!r} is not supported (dsjax can include {sorted(known)})"
    return None


def _messages_tool_choice(value: Any) -> str | None:
    if isinstance(value, dict) and value.get("disable_parallel_tool_use") is True:
        return ("tool_choice.disable_parallel_tool_use is not supported: dsjax cannot limit the model to one "
                "tool call; drop it")
    return None


def _positive(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"it must be a positive integer, got {value!r}"
    return None


def _tools(value: Any) -> str | None:
    """Server tools (web search and the like) run nowhere."""
    if not isinstance(value, list):
        return None
    for tool in value:
        if not isinstance(tool, dict):
            continue
        if tool.get("type") not in (None, "function", "custom") and "input_schema" not in tool:
            return f"the tool type {tool.get('type')!r} is a hosted tool: a batch job runs no tools; drop it"
    return None


def _reasoning(value: Any) -> str | None:
    if isinstance(value, dict) and value.get("summary") is not None:
        return "reasoning.summary is not supported: dsjax returns the reasoning itself, not a summary; drop it"
    return None


# Content a model without a document reader would see as a placeholder: refused, as images are for
# models that read none.
_DOCUMENTS = {"input_file", "file", "document", "search_result", "input_audio", "container_upload"}
_RESPONSES_ITEMS = {None, "message", "function_call", "function_call_output", "reasoning", "item_reference"}


def _parts(value: Any) -> str | None:
    """Documents, files and audio anywhere in a conversation; unknown Responses input items."""
    if isinstance(value, list):
        for x in value:
            if (why := _parts(x)) is not None:
                return why
        return None
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    if kind in _DOCUMENTS:
        return f"content of type {kind!r} is not supported: the model reads text (and images, where it has an encoder)"
    for k, v in value.items():
        if k != "tools" and (why := _parts(v)) is not None:
            return why
    return None


def _responses_input(value: Any) -> str | None:
    if isinstance(value, list):
        for item in value:
            kind = item.get("type") if isinstance(item, dict) else None
            if isinstance(item, dict) and kind not in _RESPONSES_ITEMS:
                return f"input items of type {kind!r} are not supported"
    return _parts(value)


_PENALTY = "dsjax's sampler has no {} penalty; drop it or set it to 0"
_STREAM = _only(False, why="a batch job writes whole responses, not streams; drop it or set it to false")
_PARALLEL = _only(True, why="dsjax cannot limit the model to one tool call; drop it or set it to true")
_NO_STATE = "a batch job keeps no stored responses, conversations or prompts; send the whole input instead"
# Bookkeeping of a hosted API: nothing about the answer depends on them.
_BOOKKEEPING = {k: _ANY for k in ("user", "metadata", "store", "service_tier", "safety_identifier",
                                  "prompt_cache_key", "prompt_cache_retention")}

OPTIONS: dict[str, dict[str, Callable[[Any], str | None]]] = {
    "/v1/chat/completions": {
        **_BOOKKEEPING,
        **{k: _ANY for k in ("model", "temperature", "top_p", "seed", "stop", "logprobs", "top_logprobs",
                             "tool_choice", "thinking", "reasoning_effort", "n", "stream_options")},
        "messages": _parts,
        "tools": _tools,
        "max_tokens": _positive,
        "max_completion_tokens": _positive,
        "stream": _STREAM,
        "parallel_tool_calls": _PARALLEL,
        "response_format": lambda v: _format(v, "response_format"),
        "frequency_penalty": _only(0, 0.0, why=_PENALTY.format("frequency")),
        "presence_penalty": _only(0, 0.0, why=_PENALTY.format("presence")),
        "logit_bias": _only({}, why="dsjax's sampler takes no logit bias; drop it"),
    },
    "/v1/responses": {
        **_BOOKKEEPING,
        **{k: _ANY for k in ("model", "instructions", "temperature", "top_p", "tool_choice", "top_logprobs")},
        "input": _responses_input,
        "tools": _tools,
        "reasoning": _reasoning,
        "max_output_tokens": _positive,
        "stream": _STREAM,
        "parallel_tool_calls": _PARALLEL,
        "text": _text,
        "include": _include,
        "truncation": _only("disabled", why="dsjax does not drop input to make it fit; drop it or set 'disabled'"),
        "background": _only(False, why="a batch job runs every request; drop it or set it to false"),
        "max_tool_calls": lambda v: "dsjax cannot limit the number of tool calls; drop it",
        "previous_response_id": lambda v: _NO_STATE,
        "conversation": lambda v: _NO_STATE,
        "prompt": lambda v: _NO_STATE,
    },
    "/v1/messages": {
        **{k: _ANY for k in ("model", "system", "stop_sequences", "temperature", "top_p", "thinking", "metadata",
                             "service_tier")},
        "messages": _parts,
        "tools": _tools,
        "max_tokens": _positive,
        "stream": _STREAM,
        "tool_choice": _messages_tool_choice,
        "top_k": lambda v: "dsjax's sampler has no top-k; drop it (top_p is supported)",
        "output_format": _ANY,  # read by `formats.split`, which names what is wrong
        "output_config": _ANY,
    },
}


def unsupported_option(url: str, body: dict[str, Any]) -> ErrorInfo | None:
    """An `unsupported_parameter` error naming the first option of `body` that dsjax would not carry out
    (JSON null counts as absent), or None."""
    table = OPTIONS[url]
    for key, value in body.items():
        if value is None:
            continue
        check = table.get(key)
        if check is None:
            return ErrorInfo("unsupported_parameter", f"the option {_name(key)} is not supported by dsjax for {url}; "
                                                      "remove it")
        why = check(value)
        if why is not None:
            return ErrorInfo("unsupported_parameter", f"the option {_name(key)} is not supported: {why}")
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind not in (None, "none", "auto") and not body.get("tools"):
        return ErrorInfo("unsupported_parameter", "the option 'tool_choice' asks for a tool call, but the request "
                                                  "declares no tools")
    return None


def unenforced_constraint(kind: str | None) -> ErrorInfo | None:
    """An error for an output constraint the recipe found that dsjax's constrained decoding does not know (a
    kind of a later recipe), or None (none, or one it enforces: JSON, a regex, tool calls)."""
    if kind in (None, "tool_call", "tool_call_required", "json", "regex"):
        return None
    return ErrorInfo("unsupported_parameter", f"the request asks for an output constraint of kind {kind!r}, which "
                                              "dsjax's constrained decoding does not know")


def _name(key: str) -> str:
    return repr(key if len(key) <= 100 else key[:100] + "…")
