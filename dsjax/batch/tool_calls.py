"""The grammar of a tool-call block in DSML, the markup DeepSeek's models write tool calls in, for constrained
decoding of strict tool arguments and of required tool calls.

The block, as the recipe's V4.1 prompt encoding writes it and its parser reads it (`<D>` is the `｜DSML｜`
special token; V4's spells the words `tool_calls`, `invoke` and `parameter`, without the blank):

    <<D> calls>
    <<D> invoke name="get_weather">
    <<D> parameter name="city" string="true">Paris</<D> parameter>
    <<D> parameter name="days" string="false">3</<D> parameter>
    </<D> invoke>
    </<D> calls>

`string="true"` values are raw text, `string="false"` ones JSON. A strict tool's invokes hold its parameters in
its schema's order (the optional ones may be left out), each value valid for the parameter's schema: raw text
for plain strings and string enums, JSON for the rest. A tool that is not strict gets its name held to the
tool list and its parameters left free (any name, raw or JSON values).
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance

from dsjax.engine.grammar import JSON_SPACING

# The words after `｜DSML｜` in each prompt format: the block's, an invoke's, a parameter's; and whether an invoke
# ends with an empty line (V4.1 writes one where an invoke has no parameters; allowed after any).
MARKUP = {"v4": ("tool_calls", "invoke", "parameter", False), "v4.1": (" calls", " invoke", " parameter", True)}
# Schema keys that leave a string parameter plain text (anything else, such as a pattern, is checked as JSON).
_PLAIN = {"type", "description", "title"}


def tool_call_grammar(tools_json: str, dsml: int, opened: bool, prompt_format: str = "v4.1") -> str:
    """A Lark grammar (llguidance's dialect) of a DSML tool-call block from the recipe's tool list (`tools_json`,
    Chat Completions function tools) in `prompt_format`'s markup; `dsml` is the `｜DSML｜` token's id. `opened`:
    the prompt already holds the block's first line (a required tool call), so the grammar starts at the first
    invoke; else it starts just after the block's first `｜DSML｜` token. Raises ValueError naming a tool list it
    cannot read."""
    calls, invoke, param, blank = MARKUP[prompt_format]
    tools = _read(tools_json)
    d = f"<[{dsml}]>"
    rules = [f'start: {"" if opened else _lit(calls + ">" + chr(10)) + " "}invoke+ "</" {d} {_lit(calls + ">")}',
             "invoke: " + " | ".join(f"invoke_{i}" for i in range(len(tools))),
             r"RAW: /(.|\n)*<\//",  # raw text and the `</` before the closing special token (text never holds one)
             r'NAME: /[^"\n]+/']
    for i, fn in enumerate(tools):
        head = f'"<" {d} {_lit(invoke + " name=" + json.dumps(fn["name"], ensure_ascii=False) + ">" + chr(10))}'
        tail = ('"\\n"? ' if blank else "") + f'"</" {d} {_lit(invoke + ">" + chr(10))}'
        if fn.get("strict") is not True:
            rules.append(f"invoke_{i}: {head} free_param* {tail}")
            continue
        props, required, defs = _parameters(fn)
        parts = []
        for j, (name, schema) in enumerate(props.items()):
            open_param = f'"<" {d} {_lit(param + " name=" + json.dumps(name, ensure_ascii=False) + " string=")}'
            rules.append(f"param_{i}_{j}: {open_param} {_value(schema, defs)} {d} {_lit(param + '>' + chr(10))}")
            parts.append(f"param_{i}_{j}" + ("" if name in required else "?"))
        rules.append(f"invoke_{i}: {head} {' '.join(parts)} {tail}")
    rules.append(f'free_param: "<" {d} {_lit(param + " name=" + chr(34))} NAME "\\" string=" '
                 f'("\\"true\\">" RAW | "\\"false\\">" %json {{}} "</") {d} {_lit(param + ">" + chr(10))}')
    return "\n".join(rules) + "\n"


def parameter_grammars(tools_json: str) -> list[tuple[str, str, str]]:
    """(tool, parameter, a Lark grammar of its value alone) for each strict tool's parameters: compiled one by one,
    they name the parameter whose schema a tool list's grammar failed on."""
    found = []
    for fn in _read(tools_json):
        props, _, defs = _parameters(fn)
        if fn.get("strict") is True:
            found += [(fn["name"], name, "start: " + _value(schema, defs) + "\n" + r"RAW: /(.|\n)*<\//" + "\n")
                      for name, schema in props.items()]
    return found


def _parameters(fn: dict) -> tuple[dict, set, dict]:
    """A function's parameter schemas by name (in order), the required names, and the definitions they share."""
    params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    return props, set(params.get("required") or ()), {k: params[k] for k in ("$defs", "definitions") if k in params}


def _read(tools_json: str) -> list[dict]:
    """The functions of the recipe's tool list; ValueError naming what is wrong with it."""
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as e:
        raise ValueError(f"the tool list is not JSON: {e}") from None
    if not isinstance(tools, list) or not tools:
        raise ValueError("the tool list is empty")
    fns = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool {i} of the tool list has no function name")
        fns.append(fn)
    return fns


def strict_tools(tools_json: str) -> bool:
    """Whether the recipe's tool list holds a strict tool (the recipe refuses a mix of strict and not)."""
    try:
        return any(fn.get("strict") is True for fn in _read(tools_json))
    except ValueError:
        return False


def _value(schema: Any, defs: dict) -> str:
    """The grammar of a strict parameter's `string="…">VALUE</` for its JSON schema: raw text where the model
    would write a string raw (as the recipe's encoding does), JSON for everything else."""
    if not isinstance(schema, dict):  # true, or a schema that is not one: any value
        schema = {}
    types = schema.get("type")
    choices = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if choices is not None and set(schema) <= _PLAIN | {"enum", "const"} and types in (None, "string") \
            and all(isinstance(c, str) for c in choices):
        return '"\\"true\\">" (' + " | ".join(_lit(c + "</") for c in choices) + ")"
    strings = types == "string" or isinstance(types, list) and "string" in types
    raw = _raw(schema) if strings and choices is None else None
    if raw is None:
        return _json(schema, defs)
    raw = '"\\"true\\">" /' + raw + r'<\//'
    rest = [t for t in types if t != "string"] if isinstance(types, list) else []
    if not rest:
        return raw
    return f"({raw} | {_json({**schema, 'type': rest[0] if len(rest) == 1 else rest}, defs)})"


def _raw(schema: dict) -> str | None:
    """A regex (llguidance's Lark dialect) of a string parameter's raw text, or None where only its JSON form can
    be held to the schema. A pattern searches the text, as in JSON schema, except where `^` and `$` anchor it."""
    extra = set(schema) - _PLAIN
    if not extra:
        return r"(.|\n)*"
    pattern = schema.get("pattern")
    if extra != {"pattern"} or not isinstance(pattern, str):
        return None
    head, tail = pattern.startswith("^"), pattern.endswith("$") and not pattern.endswith("\\$")
    core = pattern[1 if head else 0:len(pattern) - 1 if tail else None]
    if re.search(r"(?<!\\)[$^]", re.sub(r"\[(\\.|[^\]])*\]", "", core)):
        return None  # anchors inside (alternatives of anchored branches): the JSON form keeps them
    try:
        core = llguidance.regex_to_lark(core)
    except Exception:  # llguidance's converter raises what its parser meets: the JSON form names the problem
        return None
    return ("" if head else r"(.|\n)*") + f"({core})" + ("" if tail else r"(.|\n)*")


def _json(schema: Any, defs: dict) -> str:
    """`string="false">` then a JSON value valid for `schema` (spaced one way, as `grammar` spaces JSON)."""
    if isinstance(schema, dict):
        schema = {**(defs if "$ref" in json.dumps(schema) else {}), **schema, "x-guidance": JSON_SPACING}
    return f'"\\"false\\">" %json {json.dumps(schema, ensure_ascii=False)} "</"'


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
