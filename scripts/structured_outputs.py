"""Structured outputs through the real job: requests with JSON schemas of varied shapes, regexes and an enum
choice, run with their formats and again without (the same prompts), and the share of outputs that parse and
validate in each.

    python scripts/structured_outputs.py --model dsjax/embedded/model --count 200 --out /tmp/so --thinking-budget 1024

Writes `constrained.jsonl`, `free.jsonl` (inputs), their results and summaries, and `report.json`; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jsonschema

from dsjax.batch.job import JobConfig, run_job
from dsjax.run_config import RunConfig

_S = {"type": "string", "maxLength": 24}
_I = {"type": "integer", "minimum": -1000, "maximum": 1000}

# (what the prompt asks for, the format): schemas of objects, arrays, enums, nesting, optional and required fields.
SCHEMAS = [
    ("a person as JSON", {"type": "object", "properties": {"name": _S, "age": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 130}},
                          "required": ["name", "age"], "additionalProperties": False}),
    ("a function's name and arguments as JSON", {
        "type": "object", "properties": {"function": _S, "args": {"type": "array", "items": _S, "maxItems": 4}},
        "required": ["function", "args"], "additionalProperties": False}),
    ("a list of module names as a JSON array", {"type": "array", "items": _S, "minItems": 1, "maxItems": 5}),
    ("a sentiment label as JSON", {"type": "object", "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]}, "score": {"type": "number", "minimum": 0,
                                                                          "maximum": 1}},
        "required": ["label"], "additionalProperties": False}),
    ("a nested config as JSON", {"type": "object", "properties": {
        "server": {"type": "object", "properties": {"host": _S, "port": {"type": "integer", "minimum": 1,
                                                                          "maximum": 65535}},
                   "required": ["host", "port"], "additionalProperties": False},
        "debug": {"type": "boolean"}}, "required": ["server", "debug"], "additionalProperties": False}),
    ("a matrix of small integers as JSON", {"type": "array", "maxItems": 3,
                                            "items": {"type": "array", "items": _I, "maxItems": 3}}),
    ("a book with optional fields as JSON", {"type": "object", "properties": {
        "title": _S, "year": _I, "tags": {"type": "array", "items": {"enum": ["fiction", "science", "history"]},
                                          "maxItems": 3},
        "isbn": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{10}$"}}, "required": ["title"],
        "additionalProperties": False}),
    ("a null or a count as JSON", {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"count": _I},
                                                                "required": ["count"],
                                                                "additionalProperties": False}]}),
]
REGEXES = [
    ("a date", r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("a Python identifier", r"[a-z_][a-z0-9_]{0,15}"),
    ("a version number", r"[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,2}"),
]
CHOICE = ("yes or no", r"(yes|no)")
SUBJECTS = ["os.path.join", "json.dumps", "re.match", "collections.Counter", "itertools.chain", "functools.partial",
            "pathlib.Path", "subprocess.run", "typing.Optional", "dataclasses.field", "math.isclose", "time.sleep"]


def cases(count: int, think_every: int = 4) -> list[dict]:
    """`count` cases cycling through the schemas, the regexes and the choice; every `think_every`-th thinks first
    (0: none does)."""
    kinds = ([("json", what, s) for what, s in SCHEMAS] + [("regex", what, r) for what, r in REGEXES]
             + [("regex", *CHOICE)])
    out = []
    for i in range(count):
        kind, what, fmt = kinds[i % len(kinds)]
        subject = SUBJECTS[(i // len(kinds)) % len(SUBJECTS)]
        out.append({"id": f"case-{i:04d}", "kind": kind, "format": fmt, "think": bool(think_every) and i % think_every == think_every - 1,
                    "prompt": f"About {subject}: reply with {what}."})
    return out


def request(case: dict, model: str, constrained: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": case["prompt"]}],
            "max_tokens": 1536 if case["think"] else 160, "temperature": 0.7, "top_p": 0.9, "seed": 1,
            "thinking": {"type": "enabled" if case["think"] else "disabled"}}
    if constrained:
        body["response_format"] = (
            {"type": "json_schema", "json_schema": {"name": "answer", "strict": False, "schema": case["format"]}}
            if case["kind"] == "json" else {"type": "regex", "regex": case["format"]})
    return {"custom_id": case["id"], "method": "POST", "url": "/v1/chat/completions", "body": body}


def valid(case: dict, content: str | None) -> bool:
    """Whether `content` parses and validates against the case's schema, or fully matches its regex."""
    if content is None:
        return False
    if case["kind"] == "regex":
        return re.fullmatch(case["format"], content) is not None
    try:
        jsonschema.validate(json.loads(content), case["format"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run(model_dir: str, count: int, out: str, slots: int, max_len: int, model_name: str, think_every: int = 4,
        thinking_budget: int | None = None) -> dict:
    os.makedirs(out, exist_ok=True)
    all_cases = cases(count, think_every)
    report = {"count": count, "thinking_budget": thinking_budget}
    for name, constrained in (("constrained", True), ("free", False)):
        inp, res = os.path.join(out, f"{name}.jsonl"), os.path.join(out, f"{name}.results.jsonl")
        with open(inp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(request(c, model_name, constrained)) + "\n" for c in all_cases)
        for p in (res, os.path.splitext(res)[0] + ".summary.json"):
            if os.path.exists(p):
                os.remove(p)
        summary = run_job(JobConfig(model_dir, inp, res, RunConfig(slots=slots, max_len=max_len), progress=False,
                                    thinking_budget=thinking_budget))
        records = {r["custom_id"]: r for r in map(json.loads, open(res, encoding="utf-8"))}
        ok, errors, by_kind = 0, 0, {}
        for c in all_cases:
            r = records[c["id"]]
            if r["error"]:
                errors += 1
                good = False
            else:
                good = valid(c, r["response"]["body"]["choices"][0]["message"].get("content"))
            ok += good
            k = by_kind.setdefault(c["kind"], [0, 0])
            k[0] += good
            k[1] += 1
        report[name] = {"valid": ok, "errors": errors, "share": ok / count,
                        "by_kind": {k: f"{a}/{b}" for k, (a, b) in by_kind.items()},
                        "generated_tokens": summary["generated_tokens"],
                        "generation_seconds": summary["generation_seconds"]}
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--model-name", default=None, help="the name requests give (default: the model folder's)")
    ap.add_argument("--think-every", type=int, default=4, help="every N-th request thinks first (0: none)")
    ap.add_argument("--thinking-budget", type=int, default=None,
                    help="the job's thinking budget (`dsjax generate --thinking-budget`; default: none)")
    a = ap.parse_args(argv)
    name = a.model_name or os.path.basename(os.path.normpath(os.path.abspath(a.model)))
    report = run(a.model, a.count, a.out, a.slots, a.max_len, name, a.think_every, a.thinking_budget)
    print("| run | valid | share | JSON | regex | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in ("constrained", "free"):
        r = report[k]
        print(f"| {k} | {r['valid']}/{report['count']} | {100 * r['share']:.1f}% | {r['by_kind'].get('json', '-')} "
              f"| {r['by_kind'].get('regex', '-')} | {r['errors']} |")
    return 0 if report["constrained"]["valid"] == report["count"] else 1


if __name__ == "__main__":
    sys.exit(main())
