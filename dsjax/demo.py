"""`dsjax generate --demo`: the whole offline job on the embedded model and its bundled requests.

Nothing is downloaded: the model (`dsjax/embedded/model`, a small V4 trained on the Python standard
library by `scripts/train_tiny.py`, with an image encoder trained by `scripts/train_vision.py` to name
the colour of a shape) and the requests, one of them with an image, ship with the package. The job is the real one
(recipe in, engine, recipe out); this module only picks its settings and prints what came out.
"""

from __future__ import annotations

import json
import os
import tempfile
import textwrap
from typing import Any

from dsjax.batch.job import JobConfig, format_summary, run_job
from dsjax.embedded import MODEL_DIR, SAMPLE_REQUESTS
from dsjax.run_config import RunConfig

# Every bundled request fits: prompts of at most ~210 tokens (the image request) plus max_tokens of 160.
DEMO_RUN = RunConfig(slots=8, max_len=384, chunk_size=128, dtype="float32")


def parsed_response(body: dict[str, Any]) -> tuple[str, str]:
    """(reasoning, answer) from a chat completion, a Responses or a Messages response body."""
    if "choices" in body:  # chat completion
        msg = body["choices"][0]["message"]
        return msg.get("reasoning_content") or "", msg.get("content") or ""
    if body.get("object") == "response":
        reasoning, text = [], []
        for item in body.get("output", []):
            parts = item.get("content") or item.get("summary") or []
            target = reasoning if item.get("type") == "reasoning" else text
            target += [p.get("text", "") for p in parts]
        return "".join(reasoning), "".join(text)
    blocks = body.get("content", [])  # Messages
    return ("".join(b.get("thinking", "") for b in blocks if b.get("type") == "thinking"),
            "".join(b.get("text", "") for b in blocks if b.get("type") == "text"))


def _prompt(request: dict[str, Any]) -> str:
    body = request["body"]
    if "messages" in body:
        content = body["messages"][-1]["content"]
        if isinstance(content, str):
            return content
        return " ".join(p["text"] if p.get("type") == "text" else "[image]" for p in content)
    return body["input"] if isinstance(body["input"], str) else json.dumps(body["input"])


def _has_image(request: dict[str, Any]) -> bool:
    return "image" in json.dumps(request["body"].get("messages", ""))


def run_demo(output: str | None = None, show: int = 3, progress: bool = True, verbose: bool = False) -> dict[str, Any]:
    """Run the bundled requests through the embedded model; print `show` parsed responses, those of the
    requests with images, and the throughput summary. Results go to `output` (default: a new temporary folder)."""
    if output is None:
        output = os.path.join(tempfile.mkdtemp(prefix="dsjax-demo-"), "results.jsonl")
    summary = run_job(JobConfig(model=MODEL_DIR, input=SAMPLE_REQUESTS, output=output, run=DEMO_RUN,
                                progress=progress, verbose=verbose))
    with open(SAMPLE_REQUESTS) as f:
        requests = {r["custom_id"]: r for r in map(json.loads, f)}
    with open(output) as f:
        records = sorted(map(json.loads, f), key=lambda r: list(requests).index(r["custom_id"]))
    for rec in [r for i, r in enumerate(records) if i < show or _has_image(requests[r["custom_id"]])]:
        print(f"\n── {rec['custom_id']} ({requests[rec['custom_id']]['body']['model']}, "
              f"{requests[rec['custom_id']]['url']}) ──")
        print("user:     " + _prompt(requests[rec["custom_id"]]))
        if rec.get("error"):
            print(f"error:    {rec['error']}")
            continue
        reasoning, answer = parsed_response(rec["response"]["body"])
        if reasoning:
            print("thinking: " + textwrap.shorten(reasoning, 110))
        lines = answer.splitlines()
        print("answer:   " + "\n          ".join(lines[:12]) + ("\n          …" if len(lines) > 12 else ""))
    print("\n" + format_summary(summary))
    print(f"results: {output}")
    return summary
