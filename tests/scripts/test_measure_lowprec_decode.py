"""`scripts/measure_lowprec_decode.sh accept …`: the acceptance runs' `dsjax bench` command as it builds it,
the rows' table it prints, and its refusal of arguments it cannot use. The interpreter it starts is a stand-in
that records each bench command and writes a row per batch size instead of running the model (a V4-Flash
width does not fit a CPU test)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "measure_lowprec_decode.sh"

STAND_IN = f"""#!{sys.executable}
import json, os, sys
if sys.argv[1] == "-c":
    import dsjax.cli

    def bench(argv):
        with open(os.environ["CALLS"], "a") as f:
            f.write(json.dumps(argv) + "\\n")
        at = argv.index("--slots")
        slots = argv[at + 1:argv.index("--prompt-len")]
        with open(argv[argv.index("--json") + 1], "a") as f:
            for b in slots:
                f.write(json.dumps({{"model": argv[argv.index("--preset") + 1], "batch": int(b),
                                    "weights": argv[argv.index("--weights") + 1],
                                    "kv_dtype": argv[argv.index("--kv-dtype") + 1],
                                    "prompt_len": int(argv[argv.index("--prompt-len") + 1]),
                                    "decode_tokens_per_s": 1000.0 * int(b), "decode_of_roofline": 0.5}}) + "\\n")
        return 0

    dsjax.cli.main = bench
    exec(sys.argv[2])
else:  # the table at the end: `python - OUT` with the program on stdin
    sys.argv = sys.argv[1:]
    exec(sys.stdin.read())
"""


def measure(tmp_path, *args):
    fake = tmp_path / "python"
    fake.write_text(STAND_IN)
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "CALLS": str(tmp_path / "calls.jsonl"), "PYTHONPATH": str(ROOT)}
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_accept_runs_one_bench_as_committed_and_prints_its_rows(tmp_path):
    proc = measure(tmp_path, "accept", "v4", "keep", "fp8", "32768", "1", "32")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    (call,) = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert call == ["bench", "--preset", "v4-flash", "--layers", "4", "--weights", "keep", "--kv-dtype", "fp8",
                    "--slots", "1", "32", "--prompt-len", "32768", "--gen-len", "64", "--chunk-size", "auto",
                    "--json", str(out / "accept.jsonl")]
    assert (out / "accept_v4_keep_fp8_32768_1-32.log").read_text().splitlines()[-1] == "rc 0"
    table = [line.split() for line in proc.stdout.splitlines() if line.startswith("accept ")]
    assert [(row[1], row[2], row[3], row[5], row[7], row[8]) for row in table] == [
        ("v4-flash", "keep", "fp8", "32768", "1", "1000"), ("v4-flash", "keep", "fp8", "32768", "32", "32000")]

    proc = measure(tmp_path, "accept", "v41", "bf16", "fp4", "512", "256")  # the V4.1 slice; rows appended
    assert proc.returncode == 0, proc.stderr
    call = json.loads((tmp_path / "calls.jsonl").read_text().splitlines()[-1])
    assert call[:call.index("--slots")] == ["bench", "--preset", "v4.1-flash", "--layers", "0,1,2,3,20,21,24,25",
                                            "--engram-rows", "4194304", "--weights", "bf16", "--kv-dtype", "fp4"]
    assert len((out / "accept.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("args, message", [
    (["v5", "keep", "fp8", "512", "1"], "the model is v4 or v41, got 'v5'"),
    (["v4", "fp8", "fp8", "512", "1"], "weights are bf16 or keep, got 'fp8'"),
    (["v4", "keep", "int4", "512", "1"], "the cache is bfloat16, fp8 or fp4, got 'int4'"),
    (["v4", "keep", "fp8", "32K", "1"], "positive integers, got '32K'"),
    (["v4", "keep", "fp8", "512", "0"], "positive integers, got '0'"),
    (["v4", "keep", "fp8", "512"], "usage:"),
])
def test_accept_refuses_what_it_cannot_run(tmp_path, args, message):
    proc = measure(tmp_path, "accept", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "calls.jsonl").exists()


def test_the_model_parts_keep_their_batches_and_prompts(tmp_path):
    proc = measure(tmp_path, "model")
    assert proc.returncode == 0, proc.stderr
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    out = tmp_path / "out"
    assert [c[c.index("--json") + 1] for c in calls] == [str(out / "model_committed.jsonl"),
                                                          str(out / "model_dense_off.jsonl")]
    for c in calls:
        assert c[:c.index("--gen-len")] == ["bench", "--preset", "v4-flash", "--layers", "4", "--weights", "keep",
                                            "--slots", "32", "128", "--prompt-len", "512"]
