"""The output formats requests ask for, in the three protocols, as the grammar constrained decoding enforces
(`engine.grammar.Constraint`).

deepseek-recipe reads the formats the protocols define (Chat Completions' `response_format` json_object,
json_schema and regex; Responses' `text.format` json_object and json_schema) into the conversation's output
constraint, and writes the prompt's instructions for them. The others are dsjax's extensions or formats the recipe
does not read: `{"type": "ebnf", "ebnf": ...}` (both OpenAI protocols), `{"type": "regex", "regex": ...}` in
Responses, and Anthropic's `output_format` / `output_config.format` (json_schema) in Messages. `split` takes those
out of the body before the recipe sees it and returns them.
"""

from __future__ import annotations

import json
from typing import Any

_EXTENSIONS = {"ebnf": "ebnf", "regex": "regex"}  # the extension's type → its grammar field and Constraint kind


class FormatError(ValueError):
    """A format the request spells wrongly (a missing field, a field of the wrong type)."""


def split(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, str] | None]:
    """`(body for the recipe, (kind, text) or None)`: the body without a format the recipe does not read, and that
    format as a `Constraint` kind and text. Raises `FormatError` naming what is wrong with the format."""
    if url == "/v1/chat/completions":
        fmt = body.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") == "ebnf":
            return _without(body, "response_format"), _extension(fmt, "response_format")
    elif url == "/v1/responses":
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
        if isinstance(fmt, dict) and fmt.get("type") in _EXTENSIONS:
            rest = {k: v for k, v in text.items() if k != "format"}
            out = _without(body, "text")
            if rest:
                out["text"] = rest
            return out, _extension(fmt, "text.format")
    elif url == "/v1/messages":
        found = [(k, body[k]) for k in ("output_format", "output_config") if body.get(k) is not None]
        if len(found) > 1:
            raise FormatError("give output_config.format or output_format (its earlier name), not both")
        if found:
            key, value = found[0]
            where = key
            if key == "output_config":
                if not isinstance(value, dict):
                    raise FormatError(f"output_config must be an object, got {_kind(value)}")
                if set(value) - {"format"}:
                    raise FormatError(f"output_config.{sorted(set(value) - {'format'})[0]} is not supported: dsjax "
                                      "reads output_config.format only")
                value, where = value.get("format"), "output_config.format"
            out = _without(body, key)
            if value is None:
                return out, None
            return out, _messages_format(value, where)
    return body, None


def asks_for_format(url: str, body: Any) -> bool:
    """Whether a request body asks for a constrained output: a format, strict tools or a required tool call (read
    before the recipe: cheap, and a request it misjudges costs only a program compiled mid-job)."""
    if not isinstance(body, dict):
        return False
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    choice = body.get("tool_choice")
    if tools and (choice == "required" or isinstance(choice, dict) and choice.get("type") not in (None, "auto", "none")):
        return True  # a required or named tool call
    if any(isinstance(t, dict) and (t.get("strict") is True or isinstance(t.get("function"), dict)
                                    and t["function"].get("strict") is True) for t in tools):
        return True
    if url == "/v1/chat/completions":
        fmt = body.get("response_format")
    elif url == "/v1/responses":
        fmt = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
    else:
        return body.get("output_format") is not None or body.get("output_config") is not None
    return isinstance(fmt, dict) and fmt.get("type") not in (None, "text")


def recipe_constraint(kind: str, schema: str) -> tuple[str, str]:
    """A constraint the recipe read (`OutputConstraint.kind` and its text) as a `Constraint` kind and text, or as
    ("tool_calls", the tool list) for `batch.tool_calls`. The recipe's empty JSON schema is json_object's: an
    object, as OpenAI's JSON mode gives."""
    if kind == "json":
        return "json_schema", schema or '{"type": "object"}'
    if kind == "regex":
        return "regex", schema
    if kind in ("tool_call", "tool_call_required"):
        return "tool_calls", schema
    raise ValueError(f"no grammar for the recipe's constraint kind {kind!r}")


def _extension(fmt: dict[str, Any], where: str) -> tuple[str, str]:
    kind = fmt["type"]
    field = _EXTENSIONS[kind]
    unknown = sorted(set(fmt) - {"type", field, "name", "description"})
    if unknown:
        raise FormatError(f"{where}.{unknown[0]} is not a field of the {kind!r} format (it takes {field!r})")
    text = fmt.get(field)
    if not isinstance(text, str) or not text.strip():
        raise FormatError(f"{where} of type {kind!r} needs {where}.{field}, a non-empty string")
    return kind, text


def _messages_format(fmt: Any, where: str) -> tuple[str, str]:
    if not isinstance(fmt, dict):
        raise FormatError(f"{where} must be an object, got {_kind(fmt)}")
    if fmt.get("type") != "json_schema":
        raise FormatError(f"{where}.type must be 'json_schema', got {fmt.get('type')!r}")
    unknown = sorted(set(fmt) - {"type", "schema"})
    if unknown:
        raise FormatError(f"{where}.{unknown[0]} is not a field of the json_schema format (it takes 'schema')")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise FormatError(f"{where}.schema must be a JSON schema object, got {_kind(schema)}")
    return "json_schema", json.dumps(schema)


def _without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
