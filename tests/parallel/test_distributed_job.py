"""`dsjax generate` as two processes on localhost, 4 CPU devices each, one `dp=2,ep=4` mesh over both:
the output equals one process's, only process 0 writes, a resumed run completes it, jax.distributed
starts from flags or from the environment, and processes that do not agree refuse together."""

import argparse
import json
import shutil
import sys
import threading

import pytest

from dsjax.batch.job import summary_path
from dsjax.batch.results import comparable, record_key
from dsjax.checkpoint.convert import convert
from dsjax.cli import main
from dsjax.parallel.distributed import DistributedSpec, multi_process_env, spec_from
from dsjax.training.tokenizer import write_tokenizer
from tests.batch.test_job import records, write_jsonl
from tests.parallel.processes import free_port, process_env, run_processes, tails

M = "DeepSeek-V4-Pro"  # the tiny release checkpoint is a V4: its prompts are V4's


def chat(cid, text, **kw):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": M, "messages": [{"role": "user", "content": text}], "thinking": {"type": "disabled"},
                     **kw}}


# Four requests that run (all 5 tokens, so that they leave their 2 slots together and every prefill has the
# same shape), and three lines that become error records without reaching the engine.
REQUESTS = [
    chat("greedy", "Hi", max_tokens=5, temperature=0),
    chat("seeded", "Count to three", max_tokens=5, seed=3, temperature=0.8),
    "not json",
    {"custom_id": "responses", "method": "POST", "url": "/v1/responses",
     "body": {"model": M, "input": "hey", "max_output_tokens": 5, "reasoning": {"effort": "none"}}},
    chat("too-long", "words " * 40, max_tokens=5),
    {"custom_id": "messages", "method": "POST", "url": "/v1/messages",
     "body": {"model": M, "max_tokens": 5, "messages": [{"role": "user", "content": "Yo"}],
              "thinking": {"type": "disabled"}}},
    chat("greedy", "a duplicate custom_id", max_tokens=5),
]
JOB = ["--mesh", "dp=2,ep=4", "--slots", "2", "--max-len", "32", "--chunk-size", "16", "--dtype", "float32",
       "--quiet"]
_DIST_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def by_key(recs):
    """Records by the input line they answer, without their ids and timestamps."""
    return {record_key(r): comparable(r) for r in recs}


@pytest.fixture(scope="module")
def checkpoint(release, tmp_path_factory):
    """The tiny release checkpoint with a tokenizer of its 512-token vocabulary, converted for ep=4 (each
    process then reads only its own experts)."""
    root = tmp_path_factory.mktemp("distributed-job")
    src = root / "src"
    shutil.copytree(release, src)
    write_tokenizer(str(src / "tokenizer.json"), 512)
    convert(src, root / "orbax", ep=4, progress=False)
    return str(root / "orbax")


def _generate(checkpoint, inp, out, *extra):
    return [sys.executable, "-m", "dsjax.cli", "generate", "--model", checkpoint, "--input", inp, "--output", out,
            *JOB, *extra]


@pytest.mark.heavy
def test_two_processes_write_what_one_does_and_resume(checkpoint, tmp_path, monkeypatch):
    for var in _DIST_ENV:
        monkeypatch.delenv(var, raising=False)
    inp = write_jsonl(tmp_path / "in.jsonl", REQUESTS)
    one, two = str(tmp_path / "one.jsonl"), str(tmp_path / "two.jsonl")
    # The single-process run (here, on 8 devices) goes alongside the two processes: each compiles on
    # about one core, so the three share the machine's cores instead of waiting in turn.
    single = []
    thread = threading.Thread(target=lambda: single.append(
        main(["generate", "--model", checkpoint, "--input", inp, "--output", one, *JOB])))
    # A compilation cache spares process 0 the compiling when it resumes (process 1's cache keys differ:
    # on CPU, jax's key includes a per-process topology fingerprint).
    env = process_env(4, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"),
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    # Started with flags. Process 1 is given an output in a folder that does not exist: it never touches it.
    port = free_port()
    thread.start()
    try:
        codes, logs = run_processes(
            [_generate(checkpoint, inp, out, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                       "--process-id", str(pid)) for pid, out in ((0, two), (1, str(tmp_path / "nowhere" / "x")))],
            [env, env])
    finally:
        thread.join()
    assert single == [0] and codes == [0, 0], tails(logs)
    want = by_key(records(one))
    assert len(want) == len(REQUESTS) and sum(r["error"] is None for r in want.values()) == 4
    assert by_key(records(two)) == want and len(records(two)) == len(REQUESTS)
    assert "4 ok, 3 failed" in logs[0] and " ok, " not in logs[1]
    assert not (tmp_path / "nowhere").exists()
    assert json.load(open(summary_path(two)))["processes"] == 2

    # Resume from the environment variables: two finished requests and an error record lost, a torn line.
    recs = records(two)
    lost = [i for i, r in enumerate(recs) if r["error"] is None][:2] + [
        next(i for i, r in enumerate(recs) if r["error"] is not None)]
    with open(two, "w") as f:
        f.writelines(json.dumps(r) + "\n" for i, r in enumerate(recs) if i not in lost)
        f.write('{"id": "batch_req_torn", "custom_id": "gr')
    port = free_port()
    p1_out = tmp_path / "p1.jsonl"
    codes, logs = run_processes(
        [_generate(checkpoint, inp, out) for out in (two, str(p1_out))],
        [{**env, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid)}
         for pid in (0, 1)])
    assert codes == [0, 0], tails(logs)
    resumed = records(two)
    assert len(resumed) == len(REQUESTS) and by_key(resumed) == want  # nothing twice, nothing missing
    summary = json.load(open(summary_path(two)))
    assert summary["requests_already_done"] == len(REQUESTS) - 3 and summary["repaired_torn_bytes"] > 0
    assert summary["requests_ok"] == 2 and summary["requests_failed"] == 1
    assert not p1_out.exists() and not (tmp_path / "p1.summary.json").exists()


def test_processes_with_different_inputs_refuse_together(checkpoint, tmp_path):
    inputs = [write_jsonl(tmp_path / f"in{pid}.jsonl", REQUESTS[:2 + pid]) for pid in (0, 1)]
    port = free_port()
    codes, logs = run_processes(
        [_generate(checkpoint, inputs[pid], str(tmp_path / f"out{pid}.jsonl"), "--coordinator", f"127.0.0.1:{port}",
                   "--num-processes", "2", "--process-id", str(pid)) for pid in (0, 1)],
        [process_env(4)] * 2, timeout=300)
    for pid, log in enumerate(logs):
        assert f"process {pid}: " not in log  # neither failed its own checks
        assert "the input of process 1 differs from process 0's" in log, log[-2000:]
    assert not (tmp_path / "out1.jsonl").exists()
    assert codes == [2, 2], tails(logs)


def test_distributed_settings_from_flags_and_environment():
    def args(**kw):
        return argparse.Namespace(**{"coordinator": None, "num_processes": None, "process_id": None,
                                     "distributed": False, **kw})

    full = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert spec_from(args(), {}) is None and spec_from(None, {}) is None
    assert spec_from(args(), full) == DistributedSpec("10.0.0.1:1234", 4, 3)
    assert spec_from(args(process_id=1, coordinator="h:99"), full) == DistributedSpec("h:99", 4, 1)  # flags win
    assert spec_from(args(distributed=True), {}) == DistributedSpec(None, None, None, detect=True)
    assert spec_from(args(distributed=True, num_processes=2), {}) == DistributedSpec(None, 2, None, detect=True)
    with pytest.raises(ValueError, match=r"--process-id given, --coordinator \(or \$JAX_COORDINATOR_ADDRESS\) "
                                         r"and --num-processes \(or \$JAX_NUM_PROCESSES\) missing"):
        spec_from(args(process_id=1), {})
    with pytest.raises(ValueError, match=r"\$JAX_NUM_PROCESSES given"):
        spec_from(args(), {"JAX_NUM_PROCESSES": "2"})
    with pytest.raises(ValueError, match="must be HOST:PORT"):
        spec_from(args(coordinator="localhost", num_processes=2, process_id=0), {})
    with pytest.raises(ValueError, match="--process-id 2 is not below --num-processes 2"):
        spec_from(args(coordinator="h:1", num_processes=2, process_id=2), {})
    with pytest.raises(ValueError, match=r"\$JAX_PROCESS_ID must be an integer"):
        spec_from(args(), {**full, "JAX_PROCESS_ID": "one"})
    assert multi_process_env(full) == list(full) and multi_process_env({"JAX_PROCESS_ID": "0"}) == ["JAX_PROCESS_ID"]
    assert multi_process_env({}) == multi_process_env({**full, "JAX_NUM_PROCESSES": "1"}) == []


def test_the_cli_refuses_a_partial_or_single_process_only_setting(tmp_path, monkeypatch, capsys):
    for var in _DIST_ENV:
        monkeypatch.delenv(var, raising=False)
    assert main(["generate", "--model", "m", "--input", "i", "--output", "o", "--process-id", "1"]) == 2
    assert "--coordinator (or $JAX_COORDINATOR_ADDRESS) and --num-processes" in capsys.readouterr().err
    assert main(["generate", "--demo", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "0"]) == 2
    assert "--demo runs on one process" in capsys.readouterr().err
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 2
    assert "(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID set), but convert writes DST from one " \
           "process" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()
