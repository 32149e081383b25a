"""`dsjax generate --demo`: the whole job on the embedded model, as README's first command runs it (the run
itself is in test_compile_cache.py, which checks it with `check_demo_prints_parsed_code_and_writes_every_response`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from dsjax.demo import parsed_response

EOS = "<｜end▁of▁sentence｜>"


def _dsjax(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dsjax.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def _finish(body):
    if "choices" in body:
        return body["choices"][0]["finish_reason"]
    return body.get("stop_reason") or body.get("status")


def check_demo_prints_parsed_code_and_writes_every_response(proc, out):
    """The checks of a finished `dsjax generate --demo --output OUT --quiet` (`proc`: its
    CompletedProcess). `test_compile_cache.test_the_demo_starts_at_least_twice_as_fast_the_second_time`
    runs the demo (twice, in fresh processes, without the tests' XLA flags, as README's command runs it)
    and applies them to both runs: a run of its own here would do the same work again."""
    out = Path(out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("answer:") == 4 and "thinking:" in proc.stdout
    assert "9 ok, 0 failed" in proc.stdout and f"results: {out}" in proc.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in records) == [f"demo-{i}" for i in range(9)]
    # The image request (a purple square, drawn by `training.vision.shape_image` from seed 103) is shown
    # and answered from the image.
    assert "user:     [image] What colour is the shape?\nanswer:   purple" in proc.stdout
    image = next(r for r in records if r["custom_id"] == "demo-8")
    assert parsed_response(image["response"]["body"]) == ("", "purple")
    records = [r for r in records if r is not image]
    parsed = [parsed_response(r["response"]["body"]) for r in records]
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in records)
    # It learned the corpus: fenced Python that defines something, and thinking where it was asked for.
    assert sum(a.startswith("```python\n") and ("def " in a or "class " in a) for _, a in parsed) >= 6
    assert sum(bool(t) for t, _ in parsed) >= 2
    # A response that ended on EOS does not carry the EOS spelling in its text.
    assert any(_finish(r["response"]["body"]) in ("stop", "end_turn", "completed") for r in records)
    assert not any(EOS in t or EOS in a for t, a in parsed)
    assert os.path.exists(str(out).removesuffix(".jsonl") + ".summary.json")


def test_generate_usage_errors_name_the_problem():
    proc = _dsjax("generate", "--demo", "--model", "x")
    assert proc.returncode == 2 and "drop --model and --input" in proc.stderr
    proc = _dsjax("generate", "--input", "x.jsonl")
    assert proc.returncode == 2 and "--model, --output required (or --demo)" in proc.stderr
