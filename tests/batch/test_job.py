"""The batch job end to end on a tiny model: mixed protocols, determinism, bad input, crash and resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dsjax.batch.job import JobConfig, run_job, summary_path
from dsjax.batch.jobfile import JobError
from dsjax.batch.results import comparable
from dsjax.cli import main
from dsjax.run_config import RunConfig

RUN = RunConfig(slots=4, max_len=512, chunk_size=64, dtype="float32")
JOB = dict(run=RUN, progress=False)

M = "DeepSeek-V4-Pro"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]


def chat(cid, messages, **kw):
    return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": M, "messages": messages, **kw}}


MIXED = [
    chat("chat-system", [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi"}],
         max_tokens=6, seed=7),
    chat("chat-multiturn", [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue",
                             "reasoning_content": ""}, {"role": "user", "content": "Another?"}],
         max_tokens=5, temperature=0),
    chat("chat-tools", [{"role": "user", "content": "Weather in Paris?"},
                        {"role": "assistant", "content": "", "reasoning_content": "need a tool",
                         "tool_calls": [{"id": "call_1", "type": "function",
                                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
         tools=TOOLS, max_tokens=6, seed=3),
    chat("chat-no-thinking", [{"role": "user", "content": "Hello"}], thinking={"type": "disabled"},
         max_tokens=6, stop=["the", "a"], seed=11),
    chat("chat-logprobs", [{"role": "user", "content": "Hello"}], max_tokens=4, logprobs=True, top_logprobs=3,
         temperature=0),
    {"custom_id": "responses", "method": "POST", "url": "/v1/responses",
     "body": {"model": M, "instructions": "Be kind.", "input": [{"role": "user", "content": "Say hi"}],
              "max_output_tokens": 5, "reasoning": {"effort": "high"}}},
    {"custom_id": "responses-plain", "method": "POST", "url": "/v1/responses",
     "body": {"model": M, "input": "hi", "max_output_tokens": 4, "reasoning": {"effort": "none"}}},
    {"custom_id": "messages", "method": "POST", "url": "/v1/messages",
     "body": {"model": M, "max_tokens": 5, "system": "You are terse.",
              "messages": [{"role": "user", "content": "Hey"}], "thinking": {"type": "disabled"},
              "stop_sequences": ["zz"]}},
    {"custom_id": "messages-thinking", "method": "POST", "url": "/v1/messages",
     "body": {"model": M, "max_tokens": 6, "messages": [{"role": "user", "content": "Think"}]}},
]


def write_jsonl(path, items):
    with open(path, "w") as f:
        for x in items:
            f.write((x if isinstance(x, str) else json.dumps(x)) + "\n")
    return str(path)


def records(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


def by_id(recs):
    return {r["custom_id"] or f"line{r['line']}": comparable(r) for r in recs}


def job(tmp_path, model, items, name="out", **kw):
    inp = write_jsonl(tmp_path / f"{name}.in.jsonl", items)
    out = str(tmp_path / f"{name}.jsonl")
    summary = run_job(JobConfig(model=model, input=inp, output=out, **{**JOB, **kw}))
    return records(out), summary


def test_mixed_protocols_one_record_per_line(tmp_path, tiny_model_dir):
    recs, summary = job(tmp_path, tiny_model_dir, MIXED)
    assert sorted(r["custom_id"] for r in recs) == sorted(x["custom_id"] for x in MIXED)
    assert summary["requests_ok"] == len(MIXED) and summary["requests_failed"] == 0
    got = {r["custom_id"]: r for r in recs}
    for r in recs:
        assert r["error"] is None and r["response"]["status_code"] == 200
    body = got["chat-logprobs"]["response"]["body"]
    lp = body["choices"][0]["logprobs"]
    tokens = lp.get("content") or lp.get("reasoning_content")
    assert len(tokens) == body["usage"]["completion_tokens"] <= 4
    assert all(len(t["top_logprobs"]) == 3 for t in tokens)
    assert got["chat-system"]["response"]["body"]["usage"]["completion_tokens"] <= 6
    assert got["responses"]["response"]["body"]["object"] == "response"
    assert got["messages"]["response"]["body"]["type"] == "message"
    assert got["chat-no-thinking"]["response"]["body"]["choices"][0]["message"].get("reasoning_content") in (None, "")
    s = json.load(open(summary_path(str(tmp_path / "out.jsonl"))))
    assert s["generated_tokens"] > 0 and s["prompt_tokens"] > 0 and "host_overhead_ms_per_generated_token" in s


def test_result_is_the_same_alone_or_in_a_batch_of_50(tmp_path, tiny_model_dir):
    # Thinking mode forces temperature 1, so the greedy probe turns thinking off.
    probe = [chat("greedy", [{"role": "user", "content": "Count to three"}], max_tokens=6, temperature=0,
                  thinking={"type": "disabled"}),
             chat("seeded", [{"role": "user", "content": "Pick a word"}], max_tokens=6, seed=99, temperature=0.8),
             chat("unseeded", [{"role": "user", "content": "Any word"}], max_tokens=6)]
    fillers = [chat(f"f{i}", [{"role": "user", "content": "x" * (i % 7 + 1)}], max_tokens=(i % 5) + 1, seed=i)
               for i in range(48)]
    alone, _ = job(tmp_path, tiny_model_dir, probe, name="alone")
    mixed, _ = job(tmp_path, tiny_model_dir, fillers[:20] + probe[::-1] + fillers[20:], name="batch")
    a, b = by_id(alone), by_id(mixed)
    assert len(mixed) == 51
    for cid in ("greedy", "seeded", "unseeded"):
        assert a[cid] == b[cid]


def test_bad_input_becomes_error_records_and_the_job_goes_on(tmp_path, tiny_model_dir):
    items = [
        "{not json",
        {"method": "POST", "url": "/v1/chat/completions", "body": {"model": M, "messages": []}},
        chat("dup", [{"role": "user", "content": "a"}], max_tokens=2),
        chat("dup", [{"role": "user", "content": "b"}], max_tokens=2),
        {"custom_id": "url", "method": "POST", "url": "/v1/embeddings", "body": {}},
        {**chat("model", [{"role": "user", "content": "a"}]), "body": {"model": "gpt-4", "messages": []}},
        {**chat("body", []), "body": {"model": M, "messages": "nope"}},
        chat("long", [{"role": "user", "content": "word " * 600}]),
        chat("v41", [{"role": "user", "content": "a"}], max_tokens=2) | {"body": {
            "model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}},
        {**chat("image", []), "body": {"model": M, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {
                "url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4"
                       "//8/AAX+Av4N70a4AAAAAElFTkSuQmCC"}}]}]}},
        chat("fine", [{"role": "user", "content": "ok"}], max_tokens=2),
    ]
    inp = write_jsonl(tmp_path / "bad.jsonl", items)
    out = str(tmp_path / "bad.out.jsonl")
    assert main(["generate", "--model", tiny_model_dir, "--input", inp, "--output", out, "--slots", "4",
                 "--max-len", "512", "--chunk-size", "64", "--dtype", "float32", "--quiet"]) == 0
    recs = records(out)
    assert len(recs) == len(items)
    errors = {(r["custom_id"], r["line"]): r["error"]["code"] for r in recs if r["error"]}
    assert errors == {
        (None, 1): "invalid_json", (None, 2): "missing_custom_id", ("dup", 4): "duplicate_custom_id",
        ("url", 5): "unsupported_url", ("model", 6): "model_not_found", ("body", 7): "invalid_request",
        ("long", 8): "context_length_exceeded", ("v41", 9): "model_not_found", ("image", 10): "image_input_unsupported"}
    ok = [r["custom_id"] for r in recs if not r["error"]]
    assert sorted(ok) == ["dup", "fine"]
    assert "line 1" in next(r for r in recs if r.get("line") == 1)["error"]["message"]
    assert "holds 1 image(s); this model reads no images" in next(r for r in recs if r["custom_id"] == "image")["error"]["message"]


def test_unusable_paths_fail_before_any_work(tmp_path, tiny_model_dir, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", MIXED[:1])
    with pytest.raises(JobError, match="does not exist"):
        run_job(JobConfig(model=tiny_model_dir, input=str(tmp_path / "missing.jsonl"),
                          output=str(tmp_path / "o.jsonl"), **JOB))
    assert main(["generate", "--model", tiny_model_dir, "--input", inp, "--output",
                 str(tmp_path / "no" / "dir" / "o.jsonl"), "--quiet"]) == 2
    assert "output folder" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--input", inp, "--output", str(tmp_path / "o.jsonl"),
                 "--quiet"]) == 2
    assert "config.json" in capsys.readouterr().err
    shutil.copy(os.path.join(tiny_model_dir, "config.json"), tmp_path / "config.json")
    assert main(["generate", "--model", str(tmp_path), "--input", inp, "--output", str(tmp_path / "o.jsonl"),
                 "--quiet"]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err


def _cli(model, inp, out, *flags):
    return [sys.executable, "-m", "dsjax.cli", "generate", "--model", model, "--input", inp, "--output", out,
            "--slots", "2", "--max-len", "512", "--chunk-size", "64", "--dtype", "float32", "--quiet", *flags]


# Runs the job as a terminal would: Ctrl-C unblocked and not ignored, whatever the test process
# passes on (under the full suite, a pytest worker's child once ignored SIGINT and ran to the end).
_INTERRUPTIBLE = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_SETMASK, []); "
                  "signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


def _run_until(cmd, env, out, n_records, sig):
    """Start the job, wait until `out` holds n_records lines, send `sig`; returns the exit code."""
    log = open(out + ".stderr", "w")
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTIBLE, *cmd[1:]], env=env, stdout=log, stderr=log)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(out) and sum(1 for _ in open(out)) >= n_records:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the job ended before it could be stopped"
    at_signal = sum(1 for _ in open(out))
    proc.send_signal(sig)
    rc = proc.wait(timeout=120)
    log.close()
    if sig == signal.SIGINT and rc != 130:
        raise AssertionError(f"exit {rc} after SIGINT with {at_signal} records written, "
                             f"{sum(1 for _ in open(out))} at exit; stderr: {open(out + '.stderr').read()[-2000:]}")
    return rc


@pytest.mark.heavy
def test_interrupt_and_sigkill_then_rerun_give_one_identical_record_per_line(tmp_path, tiny_model_dir):
    # Enough work after the first records that the signals land mid-job even on a fast machine.
    # Deterministic sampling: temperature 0.7 and top_p 0.9 (with thinking off, where the recipe keeps them),
    # seeded and unseeded (drawn from the job's seed and the custom_id), whatever batches the reruns make: with
    # --batch-invariant (the default mode's prefills of several requests differ in the last bits with the batch).
    items = [chat(f"r{i}", [{"role": "user", "content": f"Tell me {i}"}], max_tokens=12 + i % 4, temperature=0.7,
                  top_p=0.9, **({"seed": i} if i % 2 else {}), **({"thinking": {"type": "disabled"}} if i % 3 else {}))
             for i in range(40)]
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    reference, _ = job(tmp_path, tiny_model_dir, items, name="uninterrupted", run=RUN.replace(slots=2,
                                                                                           batch_invariant=True))
    out = str(tmp_path / "crash.jsonl")
    # The three runs compile the same steps: a compilation cache spares the second and third that work.
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    cmd = _cli(tiny_model_dir, inp, out, "--batch-invariant")

    assert _run_until(cmd, env, out, 3, signal.SIGINT) == 130  # Ctrl-C: stops cleanly
    first = records(out)  # every line whole
    assert json.load(open(summary_path(out)))["interrupted"] is True
    assert _run_until(cmd, env, out, len(first) + 2, signal.SIGTERM) == 143  # as Slurm or Kubernetes stop jobs
    s = json.load(open(summary_path(out)))
    assert s["interrupted"] is True and s["signal"] == "SIGTERM" and s["requests_already_done"] == len(first)
    first = records(out)

    _run_until(cmd, env, out, len(first) + 3, signal.SIGKILL)
    partial = sum(1 for _ in open(out))
    assert len(first) < partial < len(items)
    with open(out, "ab") as f:
        f.write(b'{"id": "batch_req_torn", "custom_id": "r')  # as if killed mid-write
    assert main(cmd[3:]) == 0  # the rerun, in this process: it has no signal to take, and skips a start-up
    recs = records(out)
    assert len(recs) == len(items)
    assert by_id(recs) == by_id(reference)
    summary = json.load(open(summary_path(out)))
    assert summary["requests_already_done"] == partial and summary["repaired_torn_bytes"] > 0


@pytest.mark.heavy
def test_fp8_checkpoint_with_quantized_cache_through_the_cli(tmp_path, tiny_fp8_model_dir, capsys):
    """`--weights keep` (FP8/FP4 on the device) and `--weights bf16` (dequantized at load) give the same
    greedy text on an FP8 checkpoint; `--kv-dtype` changes only the cache's storage."""
    probe = [chat(f"g{i}", [{"role": "user", "content": text}], max_tokens=5, temperature=0,
                  thinking={"type": "disabled"}) for i, text in enumerate(["Count to three", "Name a color"])]
    inp = write_jsonl(tmp_path / "in.jsonl", probe)
    outs = {}
    for weights, kv in (("keep", "fp8"), ("bf16", "fp8"), ("keep", "fp4")):
        out = str(tmp_path / f"{weights}-{kv}.jsonl")
        argv = ["generate", "--model", tiny_fp8_model_dir, "--input", inp, "--output", out, "--slots", "2",
                "--max-len", "256", "--chunk-size", "64", "--dtype", "float32", "--weights", weights,
                "--kv-dtype", kv, "--quiet"]
        assert main(argv) == 0, capsys.readouterr().err
        recs = records(out)
        assert all(r["error"] is None for r in recs)
        outs[weights, kv] = by_id(recs)
        assert json.load(open(summary_path(out)))["config"]["run"]["kv_dtype"] == kv
    assert outs["keep", "fp8"] == outs["bf16", "fp8"]
    with pytest.raises(SystemExit):
        main(["generate", "--model", tiny_fp8_model_dir, "--input", inp, "--output", str(tmp_path / "x.jsonl"),
              "--kv-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_a_converted_checkpoint_generates_the_same_text(tmp_path, tiny_fp8_model_dir, capsys):
    """`dsjax convert` output (Orbax, tokenizer copied) serves `dsjax generate` like its source."""
    probe = [chat(f"c{i}", [{"role": "user", "content": text}], max_tokens=5, temperature=0,
                  thinking={"type": "disabled"}) for i, text in enumerate(["Count to three", "Name a color"])]
    inp = write_jsonl(tmp_path / "in.jsonl", probe)
    converted = str(tmp_path / "converted")
    assert main(["convert", tiny_fp8_model_dir, converted, "--quiet"]) == 0, capsys.readouterr().err
    outs = []
    for model in (tiny_fp8_model_dir, converted):
        out = str(tmp_path / f"{len(outs)}.jsonl")
        assert main(["generate", "--model", model, "--input", inp, "--output", out, "--slots", "2",
                     "--max-len", "256", "--chunk-size", "64", "--dtype", "float32", "--quiet"]) == 0
        outs.append(by_id(records(out)))
    assert outs[0] == outs[1] and all(r["error"] is None for r in outs[1].values())


def test_mesh_runs_the_job_expert_parallel_with_the_same_text(tmp_path, tiny_model_dir, capsys):
    """`--mesh dp=2,ep=4` on the 8 test devices: the experts are split, the greedy text is unchanged."""
    probe = [chat(f"m{i}", [{"role": "user", "content": text}], max_tokens=6, temperature=0,
                  thinking={"type": "disabled"}) for i, text in enumerate(["Count to three", "Name a color", "Hi"])]
    inp = write_jsonl(tmp_path / "in.jsonl", probe)
    outs = []
    for mesh in ([], ["--mesh", "dp=2,ep=4"]):
        out = str(tmp_path / f"{len(outs)}.jsonl")
        assert main(["generate", "--model", tiny_model_dir, "--input", inp, "--output", out, "--slots", "4",
                     "--max-len", "256", "--chunk-size", "64", "--dtype", "float32", "--quiet", *mesh]) == 0
        outs.append(by_id(records(out)))
    assert outs[0] == outs[1]
    assert json.load(open(summary_path(out)))["config"]["run"]["mesh"] == "dp=2,ep=4"
    assert main(["generate", "--model", tiny_model_dir, "--input", inp, "--output", str(tmp_path / "x.jsonl"),
                 "--mesh", "ep=3"]) == 2
    assert "needs 3 devices; 8 are available" in capsys.readouterr().err


def test_the_served_names_default_to_the_checkpoints_and_are_set_by_flag(tmp_path, tiny_model_dir, capsys):
    folder = os.path.basename(os.path.normpath(tiny_model_dir))
    items = [chat("recipe-name", [{"role": "user", "content": "Hi"}], max_tokens=2, seed=5),
             {**chat("folder-name", []), "body": {"model": folder, "messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 2}},
             {**chat("other", []), "body": {"model": "DeepSeek-V4-Flash", "messages": [{"role": "user", "content": "Hi"}]}},
             {**chat("mine", []), "body": {"model": "my-model", "messages": [{"role": "user", "content": "Hi"}],
                                           "max_tokens": 2, "seed": 5}}]
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    argv = ["generate", "--model", tiny_model_dir, "--input", inp, "--slots", "4", "--max-len", "512",
            "--chunk-size", "64", "--dtype", "float32", "--quiet"]
    assert main([*argv, "--output", str(tmp_path / "a.jsonl")]) == 0
    got = {r["custom_id"]: r for r in records(tmp_path / "a.jsonl")}
    assert got["recipe-name"]["response"]["body"]["model"] == M
    assert got["folder-name"]["response"]["body"]["model"] == folder  # the name the request used
    for cid in ("other", "mine"):
        err = got[cid]["error"]
        assert err["code"] == "model_not_found" and f"serves [{folder!r}, 'DeepSeek-V4-Pro']" in err["message"]
    summary = json.load(open(summary_path(str(tmp_path / "a.jsonl"))))
    assert summary["served_model_names"] == [folder, M] and summary["prompt_format"] == "v4"

    assert main([*argv, "--output", str(tmp_path / "b.jsonl"), "--served-model-name", "my-model", "alias"]) == 0
    got = {r["custom_id"]: r for r in records(tmp_path / "b.jsonl")}
    assert got["mine"]["error"] is None and got["mine"]["response"]["body"]["model"] == "my-model"
    # The prompt format is the checkpoint's whatever the name: the same text under the new name.
    assert comparable(got["mine"]["response"]["body"]["choices"]) == comparable(
        records(tmp_path / "a.jsonl")[[r["custom_id"] for r in records(tmp_path / "a.jsonl")].index("recipe-name")]
        ["response"]["body"]["choices"])
    assert all(got[c]["error"]["code"] == "model_not_found" for c in ("recipe-name", "folder-name", "other"))
    assert "['my-model', 'alias']" in got["other"]["error"]["message"]
    out = capsys.readouterr().out
    assert "load " in out and "compile " in out and "generation " in out


def test_v4_and_v41_checkpoints_encode_in_their_own_format(tmp_path, tiny_blind_model_dir, tiny_vision_model_dir):
    import deepseek_recipe as dr

    messages = [{"role": "user", "content": "Say something"}]
    for model, fmt, name, encoding in ((tiny_blind_model_dir, "v4", M, dr.DeepseekV4Encoding()),
                                       (tiny_vision_model_dir, "v4.1", "DeepSeek-V4.1-Flash", dr.DeepseekV41Encoding())):
        line = {**chat("x", messages, max_tokens=2), "body": {"model": name, "messages": messages, "max_tokens": 2}}
        recs, summary = job(tmp_path, model, [line], name=fmt)
        assert summary["prompt_format"] == fmt and recs[0]["error"] is None
        conv = dr.ChatCompletionRequest(line["body"]).convert(dr.ConversionOptions())
        tok = dr.Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
        assert recs[0]["response"]["body"]["usage"]["prompt_tokens"] == len(encoding.with_tokenizer(tok).encode(
            conv.conversation))
    with pytest.raises(JobError, match="needs the v4.1 prompt format"):
        job(tmp_path, tiny_vision_model_dir, [line], name="forced", prompt_format="v4")


def test_the_summary_keeps_start_up_apart_from_the_generation_loop(tmp_path, tiny_model_dir):
    _, s = job(tmp_path, tiny_model_dir, MIXED[:4])
    # (Programs this test process compiled before are reused from memory: none need be compiled here.)
    assert s["load_seconds"] > 0 and s["generation_seconds"] > 0 and s["programs_compiled"] >= s["programs_from_cache"]
    assert s["load_seconds"] + s["generation_seconds"] <= s["wall_seconds"]
    assert s["compile_seconds"] <= s["wall_seconds"]
    # The rates are rounded to 2 decimals: below 5 tokens/s (a loaded machine) that is more than 1e-3 of them.
    assert s["generated_tokens_per_second"] == pytest.approx(s["generated_tokens"] / s["generation_seconds"], rel=1e-3,
                                                             abs=0.006)
    assert s["prompt_tokens_per_second"] == pytest.approx(s["prompt_tokens"] / s["generation_seconds"], rel=1e-3,
                                                          abs=0.006)
    # The steps' first runs compile them: that time is the compile figure's, not the steps'.
    assert 0 < s["engine_step_seconds"] <= s["generation_seconds"] and s["host_overhead_ms_per_generated_token"] > 0


def test_the_generation_is_timed_from_the_end_of_start_up(tmp_path, tiny_model_dir, monkeypatch):
    # Preparing the programs is more than jax's compile spans (loading whole programs, timing the widths): none of
    # it is the generation's. Three seconds that jax does not see stand for that part here.
    from dsjax.engine.engine import Engine

    real = Engine.precompile
    monkeypatch.setattr(Engine, "precompile", lambda self, *a, **k: time.sleep(3.0) or real(self, *a, **k))
    _, s = job(tmp_path, tiny_model_dir, MIXED[:4])
    assert s["precompile_seconds"] >= 3.0
    assert s["load_seconds"] + s["precompile_seconds"] + s["generation_seconds"] <= s["wall_seconds"], s


def test_careless_lines_are_errors_of_their_own_and_the_job_goes_on(tmp_path, tiny_vision_model_dir):
    v41 = "DeepSeek-V4.1-Flash"
    os.mkfifo(tmp_path / "pipe.png")
    os.symlink("/etc/passwd", tmp_path / "sneaky.png")

    def body(**kw):
        return {"model": v41, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kw}

    def image(path):
        return body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": path}}]}])

    def line(cid, b):
        return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": b})

    items = [
        line("seed", body(seed=2 ** 64)), line("max-tokens", body(max_tokens=2 ** 64)),
        '{"custom_id": "digits", "method": "POST", "url": "/v1/chat/completions", "body": {"seed": '
        + "9" * 5000 + "}}",
        "[" * 100_000 + "]" * 100_000,
        line("nul", image("a\0b.png")), line("surrogate", image("\ud800.png")),
        line("fifo", image("pipe.png")), line("passwd", image("/etc/passwd")), line("up", image("../x.png")),
        line("link", image("sneaky.png")), line("missing-outside", image("/nonexistent/x.png")),
        line("logit-bias", body(logit_bias={"5": 1})), line("json", body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})),
        line("penalty", body(frequency_penalty=0.5)), line("\ud800-id", body()),
        line("fine", body()),
    ]
    t = time.monotonic()
    recs, summary = job(tmp_path, tiny_vision_model_dir, items)
    assert time.monotonic() - t < 240  # the FIFO did not hang the job
    codes = {r["custom_id"] or r["line"]: (r["error"] or {}).get("code") for r in recs}
    assert codes == {"seed": "invalid_request", "max-tokens": "invalid_request", 3: "invalid_json", 4: "invalid_json",
                     "nul": "invalid_image", "surrogate": "invalid_image", "fifo": "invalid_image",
                     "passwd": "invalid_image", "up": "invalid_image", "link": "invalid_image",
                     "missing-outside": "invalid_image", "logit-bias": "unsupported_parameter",
                     "json": "invalid_request", "penalty": "unsupported_parameter", "\ud800-id": None, "fine": None}
    by = {r["custom_id"]: r["error"]["message"] for r in recs if r["error"] and r["custom_id"]}
    outside = [by[c].replace(repr(p), "PATH") for c, p in (("passwd", "/etc/passwd"), ("missing-outside",
                                                                                         "/nonexistent/x.png"))]
    assert outside[0] == outside[1] and "outside the folder" in outside[0]  # nothing tells whether it exists
    assert "logit_bias" in by["logit-bias"] and "objectx" in by["json"]
    assert summary["requests_ok"] == 2 and summary["requests_failed"] == len(items) - 2


def test_paths_the_job_cannot_use_fail_before_any_work(tmp_path, tiny_model_dir, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", MIXED[:1])
    before = open(inp, "rb").read()
    base = ["generate", "--model", tiny_model_dir, "--input", inp, "--quiet"]
    assert main([*base, "--output", inp]) == 2  # the output is the input
    assert "is the input file" in capsys.readouterr().err and open(inp, "rb").read() == before
    (tmp_path / "out.summary.json").mkdir()  # the summary cannot be written
    assert main([*base, "--output", str(tmp_path / "out.jsonl")]) == 2
    assert "summary" in capsys.readouterr().err and not os.path.exists(tmp_path / "out.jsonl")
    with pytest.raises(SystemExit):
        main([*base, "--output", str(tmp_path / "o.jsonl"), "--seed", "-1"])
    assert "--seed: must be in [0, 9223372036854775808), got -1" in capsys.readouterr().err
    with pytest.raises(JobError, match="seed must be an integer"):
        run_job(JobConfig(model=tiny_model_dir, input=inp, output=str(tmp_path / "o.jsonl"), seed=-1))
    with pytest.raises(JobError, match="run must be a RunConfig, got dict"):
        run_job(JobConfig(model=tiny_model_dir, input=inp, output=str(tmp_path / "o.jsonl"), run={"slots": 2}))
    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    (bad / "tokenizer.json").write_text("{}")
    assert main([*base[:1], "--model", str(bad), *base[3:], "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "config.json" in capsys.readouterr().err
    garbage = tmp_path / "garbage-tokenizer"
    shutil.copytree(tiny_model_dir, garbage)
    (garbage / "tokenizer.json").write_bytes(b"\x00garbage")
    assert main([*base[:1], "--model", str(garbage), *base[3:], "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "tokenizer.json: not a tokenizer file" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o.jsonl")


def test_a_resume_from_a_changed_input_is_refused_unless_asked_for(tmp_path, tiny_model_dir, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", MIXED[:1])
    out = str(tmp_path / "out.jsonl")
    argv = ["generate", "--model", tiny_model_dir, "--input", inp, "--output", out, "--slots", "2",
            "--max-len", "256", "--chunk-size", "64", "--dtype", "float32", "--quiet"]
    assert main(argv) == 0
    write_jsonl(tmp_path / "in.jsonl", MIXED[:2])
    assert main(argv) == 2
    assert "changed since" in capsys.readouterr().err and len(records(out)) == 1
    assert main([*argv, "--allow-changed-input"]) == 0
    assert [r["custom_id"] for r in records(out)] == [MIXED[0]["custom_id"], MIXED[1]["custom_id"]]
    s = json.load(open(summary_path(out)))
    assert s["input_changed"] and s["requests_already_done"] == 1


def test_an_output_to_a_pipe_is_refused_at_once(tmp_path, tiny_model_dir):
    """`--output /dev/stdout` into a pipe: refused before anything is read from or written to it."""
    inp = write_jsonl(tmp_path / "in.jsonl", MIXED[:1])
    proc = subprocess.run([sys.executable, "-m", "dsjax.cli", "generate", "--model", tiny_model_dir, "--input", inp,
                           "--output", "/dev/stdout", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert "is a device or a process's file" in proc.stderr


def test_a_summary_another_output_owns_is_not_overwritten(tmp_path):
    from dsjax.batch.job import _check_writable

    inp = write_jsonl(tmp_path / "in.jsonl", MIXED[:1])
    (tmp_path / "o.txt").write_text("")
    (tmp_path / "o.summary.json").write_text(json.dumps({"output_path": str(tmp_path / "o.txt")}))
    with pytest.raises(JobError, match="is that of another output"):
        _check_writable(str(tmp_path / "o.summary.json"), inp, "summary", str(tmp_path / "o.jsonl"))
    _check_writable(str(tmp_path / "o.summary.json"), inp, "summary", str(tmp_path / "o.txt"))


def test_a_job_that_fails_to_load_leaves_no_files_and_one_with_nothing_to_do_loads_nothing(tmp_path, tiny_model_dir,
                                                                                          capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(os.path.join(tiny_model_dir, name), broken / name)
    (broken / "model.safetensors").write_bytes(b"\x10\x00garbage")
    inp = write_jsonl(tmp_path / "in.jsonl", MIXED[:1])
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--model", str(broken), "--input", inp, "--output", str(out), "--quiet"]) == 2
    assert "model.safetensors" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["broken", "in.jsonl"]
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    s = run_job(JobConfig(model=str(broken), input=empty, output=str(out), **JOB))  # the weights are never read
    assert s["requests_ok"] == 0 and s["load_seconds"] == 0 and out.read_bytes() == b""


def test_a_stop_signal_python_swallowed_still_stops_the_job():
    from dsjax.batch.job import Terminated, _Stopper

    with _Stopper() as stop:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        except Terminated:
            pass  # as an exception raised in a garbage-collector callback is lost
        with pytest.raises(Terminated):
            stop.check()
        stop.finishing = True
        os.kill(os.getpid(), signal.SIGINT)  # while the summary is written: remembered, not raised
        time.sleep(0.1)
        stop.check()
        assert stop.signal == "SIGTERM"


def test_a_cache_larger_than_the_devices_is_refused_before_loading(tmp_path, tiny_model_dir):
    inp = write_jsonl(tmp_path / "in.jsonl", MIXED[:1])
    with pytest.raises(JobError, match=r"--slots 10000000 sequences of 512 tokens needs .* GB, more than"):
        run_job(JobConfig(model=tiny_model_dir, input=inp, output=str(tmp_path / "o.jsonl"),
                          **{**JOB, "run": RUN.replace(slots=10_000_000)}))
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_every_program_is_compiled_before_the_first_request(tmp_path, tiny_model_dir):
    """Requests that need the sampler's other parts arrive late (a window of 2, 3 slots, greedy first):
    the programs were compiled before the loop all the same, so none is compiled inside it. (Shapes no
    other test uses: nothing comes from this process's memory.)"""
    late = [chat("late-top-p", [{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0.8, top_p=0.5,
                 seed=1),
            chat("late-logprobs", [{"role": "user", "content": "Hi"}], max_tokens=3, logprobs=True, top_logprobs=2)]
    greedy = [chat(f"greedy-{i}", [{"role": "user", "content": "Hi " * i}], max_tokens=4, temperature=0)
              for i in range(5)]
    recs, s = job(tmp_path, tiny_model_dir, greedy + late, run=RUN.replace(slots=3, max_len=456), window=2)
    assert s["requests_ok"] == 7 and len(recs) == 7
    assert s["programs_compiled"] > 0 and s["precompile_seconds"] > 0
    assert s["programs_compiled_during_generation"] == 0


def test_a_late_format_and_one_request_prefills_are_compiled_before_the_first_request(tmp_path, tiny_model_dir):
    """A constrained request late in the input (after a window of greedy ones) and `batch_invariant`'s prefills of
    one request: both were built before the loop (the input is scanned for formats at start-up)."""
    greedy = [chat(f"greedy-{i}", [{"role": "user", "content": "Hi " * i}], max_tokens=4, temperature=0,
                   thinking={"type": "disabled"}) for i in range(4)]
    late = chat("late-regex", [{"role": "user", "content": "Pick"}], max_tokens=8, temperature=0.8, seed=3,
                thinking={"type": "disabled"}, response_format={"type": "regex", "regex": "(up|down)"})
    recs, s = job(tmp_path, tiny_model_dir, greedy + [late], run=RUN.replace(slots=3, max_len=456, batch_invariant=True),
                  window=2)
    assert s["requests_ok"] == 5 and s["programs_compiled_during_generation"] == 0
    assert s["config"]["run"]["batch_invariant"] is True
    answer = by_id(recs)["late-regex"]["response"]["body"]["choices"][0]
    assert answer["message"]["content"] in ("up", "down") and answer["finish_reason"] == "stop"


@pytest.mark.heavy
def test_a_v41_checkpoint_runs_the_job_in_its_own_format_with_the_packed_cache(tmp_path, capsys):
    """A synthetic DeepSeek-V4.1 checkpoint (release layout, tiny-v4.1) through `dsjax generate` with the
    release's packed cache: prompts in the V4.1 encoding (the prompt token counts are deepseek-recipe's); one
    greedy request three times over two slots gives one text (the third reuses a slot: an earlier request's
    Engram history once leaked into it); a re-run resumes with nothing left to do. (In thinking mode the recipe
    samples at temperature 1 whatever the request says, so the greedy ones turn thinking off.)"""
    import deepseek_recipe as dr

    from dsjax.checkpoint.synthetic import word_level_tokenizer, write_synthetic_v41
    from dsjax.config_v41 import V41Config
    from dsjax.presets import tiny_v41_vocabulary
    from dsjax.training.tokenizer import special_token_strings

    folder = str(tmp_path / "v41")
    write_synthetic_v41(folder, V41Config.preset("tiny-v4.1"), seed=3,
                        tokenizer=word_level_tokenizer(tiny_v41_vocabulary(), special_token_strings()))
    name = "DeepSeek-V4.1-Flash"
    messages = [{"role": "user", "content": "the cat sat on the mat"}]
    greedy = dict(max_tokens=8, temperature=0, thinking={"type": "disabled"})
    lines = [{**chat(cid, messages), "body": {"model": name, "messages": messages, **kw}}
             for cid, kw in (("a", greedy), ("b", greedy), ("c", greedy), ("d", dict(max_tokens=6, seed=5)))]
    inp, out = write_jsonl(tmp_path / "in.jsonl", lines), str(tmp_path / "out.jsonl")
    argv = ["generate", "--model", folder, "--input", inp, "--output", out, "--kv-dtype", "fp4", "--slots", "2",
            "--max-len", "256", "--chunk-size", "32", "--no-compile-cache", "--quiet"]
    assert main(argv) == 0
    recs = {r["custom_id"]: r for r in records(out)}
    assert sorted(recs) == ["a", "b", "c", "d"] and all(r["error"] is None for r in recs.values())
    with open(summary_path(out)) as f:
        summary = json.load(f)
    assert summary["prompt_format"] == "v4.1" and summary["config"]["run"]["kv_dtype"] == "fp4"
    tok = dr.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    bodies = {k: r["response"]["body"] for k, r in recs.items()}
    for line in lines:
        conv = dr.ChatCompletionRequest(line["body"]).convert(dr.ConversionOptions())
        want = len(dr.DeepseekV41Encoding().with_tokenizer(tok).encode(conv.conversation))
        assert bodies[line["custom_id"]]["usage"]["prompt_tokens"] == want
    assert bodies["d"]["usage"]["completion_tokens"] == 6
    assert comparable(bodies["a"]["choices"]) == comparable(bodies["b"]["choices"]) == comparable(bodies["c"]["choices"])
    before = open(out).read()
    capsys.readouterr()
    assert main(argv) == 0
    assert open(out).read() == before and "0 ok, 0 failed, 4 already done" in capsys.readouterr().out


def test_requests_are_prepared_on_a_pool_of_threads(tmp_path, tiny_model_dir, monkeypatch):
    """The recipe's preparation (image resolution above all) runs on `PREPARE_THREADS` threads, several
    requests at once; bad lines and rejected requests still get their error records, every line one record."""
    import threading

    from dsjax.batch import job
    from dsjax.batch.recipe import Recipe

    monkeypatch.setattr(job, "PREPARE_THREADS", 4)
    prepare, running, seen = Recipe.prepare, [0], []
    lock = threading.Lock()

    def slow(self, line):
        with lock:
            running[0] += 1
            seen.append((threading.current_thread().name, running[0]))
        time.sleep(0.1)
        with lock:
            running[0] -= 1
        return prepare(self, line)

    monkeypatch.setattr(Recipe, "prepare", slow)
    items = [chat(f"r{i}", [{"role": "user", "content": f"Say {i}"}], max_tokens=2) for i in range(12)]
    items[5] = "{not json"
    items[7] = chat("r7", [{"role": "user", "content": "x"}], max_tokens=2, model="unknown-model")
    inp = write_jsonl(tmp_path / "in.jsonl", items)
    summary = run_job(JobConfig(model=tiny_model_dir, input=inp, output=str(tmp_path / "out.jsonl"), **JOB))
    assert (summary["requests_ok"], summary["requests_failed"]) == (10, 2)
    assert len(records(tmp_path / "out.jsonl")) == 12
    assert len(seen) == 11 and all(name.startswith("dsjax-prepare") for name, _ in seen)
    assert max(n for _, n in seen) > 1


@pytest.mark.heavy
def test_speculative_decoding_runs_the_job_and_reports_the_acceptance(tmp_path, capsys):
    """`dsjax generate --speculative dspark` on a synthetic DeepSeek-V4.1 checkpoint with DSpark stages (`mtp.*`):
    every request answered, every program built before the first request and none after, the summary and the
    closing line say what the verification kept; a checkpoint without stages is refused before any weight is read.
    (That the tokens are those of `--speculative off`: `tests/engine/test_scheduler_speculative.py`.)"""
    from dsjax.checkpoint.synthetic import word_level_tokenizer, write_synthetic_v41
    from dsjax.config_v41 import V41Config
    from dsjax.presets import tiny_v41_vocabulary
    from dsjax.training.tokenizer import special_token_strings

    base = V41Config.preset("tiny-v4.1")
    cfg = base.replace(num_nextn_predict_layers=3, compress_ratios=base.compress_ratios + (0, 0, 0),
                       dspark_block_size=5, dspark_noise_token_id=254, dspark_target_layer_ids=(5, 6, 7),
                       dspark_markov_rank=8, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2)
    folder = str(tmp_path / "v41")
    write_synthetic_v41(folder, cfg, seed=3, tokenizer=word_level_tokenizer(tiny_v41_vocabulary(),
                                                                              special_token_strings()))
    name = "DeepSeek-V4.1-Flash"
    greedy = dict(max_tokens=9, temperature=0, thinking={"type": "disabled"})
    lines = [{**chat(f"r{i}", []), "body": {"model": name, "messages": [{"role": "user", "content": text}], **greedy}}
             for i, text in enumerate(["the cat sat on the mat", "a dog", "the mat sat on a cat on a dog"])]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    argv = ["generate", "--model", folder, "--input", inp, "--slots", "2", "--max-len", "128", "--chunk-size", "32",
            "--no-compile-cache", "--quiet"]
    out = str(tmp_path / "out.jsonl")
    capsys.readouterr()
    assert main(argv + ["--output", out, "--speculative", "dspark", "--drafts", "3"]) == 0
    recs = records(out)
    assert len(recs) == 3 and all(r["error"] is None for r in recs)
    assert all(1 <= r["response"]["body"]["usage"]["completion_tokens"] <= 9 for r in recs)
    with open(summary_path(out)) as f:
        summary = json.load(f)
    spec = summary["speculative"]
    assert spec["target_steps"] > 0 and spec["steps_by_width"] == {"4": spec["target_steps"]}
    assert summary["programs_compiled_during_generation"] == 0
    assert "DSpark:" in capsys.readouterr().out
    plain = str(tmp_path / "plain")
    write_synthetic_v41(plain, base, seed=3, tokenizer=word_level_tokenizer(tiny_v41_vocabulary(),
                                                                             special_token_strings()))
    with pytest.raises(JobError, match="DSpark draft stages"):
        run_job(JobConfig(model=plain, input=inp, output=str(tmp_path / "x.jsonl"),
                          run=RunConfig(speculative="dspark")))
    assert not os.path.exists(tmp_path / "x.jsonl")


def test_a_thinking_budget_ends_each_thinking_part_in_time(tmp_path, tiny_model_dir):
    """`thinking_budget` 6 (a Messages request's own budget_tokens 3): each thinking part ends by then, the answer
    gets the rest of max_tokens, and a request without thinking is left alone."""
    items = [chat(f"t{i}", [{"role": "user", "content": f"Think {i}"}], max_tokens=24, temperature=1.0, seed=i)
             for i in range(3)]
    items.append(chat("plain", [{"role": "user", "content": "Hi"}], max_tokens=24, temperature=1.0, seed=9,
                      thinking={"type": "disabled"}))
    items.append({"custom_id": "msg", "method": "POST", "url": "/v1/messages", "body": {
        "model": M, "max_tokens": 24, "temperature": 1.0, "thinking": {"type": "enabled", "budget_tokens": 3},
        "messages": [{"role": "user", "content": "Think"}]}})
    recs, s = job(tmp_path, tiny_model_dir, items, thinking_budget=6)
    assert s["requests_ok"] == 5 and s["programs_compiled_during_generation"] == 0
    got = by_id(recs)
    for i in range(3):
        usage = got[f"t{i}"]["response"]["body"]["usage"]
        assert 1 <= usage["completion_tokens_details"]["reasoning_tokens"] <= 7, usage  # 6 and the </think>
        assert usage["completion_tokens"] > usage["completion_tokens_details"]["reasoning_tokens"]
    msg = got["msg"]["response"]["body"]
    thought = [b for b in msg["content"] if b["type"] == "thinking"]
    assert thought and msg["usage"]["output_tokens"] >= 4
    with pytest.raises(JobError, match="thinking_budget"):
        job(tmp_path, tiny_model_dir, items, name="bad", thinking_budget=-1)
