"""The persistent compile cache every `dsjax` command uses: where it lives, that a fresh process loads
what an earlier one compiled, that a changed program compiles anew, that processes can share it, and that
`--no-compile-cache` and an unusable folder leave the command working and the disk untouched.

The jobs run in fresh processes (`python -m dsjax.cli`), as a user's do, on a tiny model; each test gets
its own cache folder through DSJAX_CACHE_DIR."""

import json
import os
import shutil
import subprocess
import sys
import time

import jax
import pytest
from absl import logging as absl_logging

from dsjax import cli
from dsjax.compile_cache import cache_dir, enable_compile_cache, may_use_a_gpu
from dsjax.demo import parsed_response
from tests.test_demo import check_demo_prints_parsed_code_and_writes_every_response

PROMPTS = ["Count to three", "Name a colour"]
JOB = ["--served-model-name", "tiny", "--slots", "2", "--max-len", "64", "--chunk-size", "16",
       "--dtype", "float32", "--quiet"]


def _env(cache, **more) -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "DSJAX_CACHE_DIR": str(cache), **more}


def _dsjax(*args, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dsjax.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _generate(job, output, env, *more) -> subprocess.Popen:
    return _dsjax("generate", "--model", job["model"], "--input", job["input"], "--output", str(output), *JOB,
                  *more, env=env)


def _result(proc: subprocess.Popen, output) -> dict:
    """The finished run's summary (with its "stdout" and "stderr") and answers by custom_id."""
    done = _finished(proc)
    assert done.returncode == 0, done.stderr[-3000:]
    # jax warns (and compiles) if it could not read an entry, e.g. one another process was still writing.
    assert "compilation cache" not in done.stderr, done.stderr[-3000:]
    summary = json.loads(open(str(output).removesuffix(".jsonl") + ".summary.json").read())
    with open(output) as f:
        records = [json.loads(line) for line in f]
    answers = {r["custom_id"]: (parsed_response(r["response"]["body"]), r["response"]["body"]["usage"])
               for r in records}
    return {**summary, "stdout": done.stdout, "stderr": done.stderr, "answers": answers}


def _entries(cache) -> list[str]:
    """The programs in the cache, by file name (`jit_<function>-<key>-cache`)."""
    return [name for name in os.listdir(cache / "jax") if name.endswith("-cache")]


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    """A one-layer model (the smallest that runs the whole job, the quickest to compile; the embedded
    model's tokenizer) and two greedy requests for it."""
    from flax import nnx

    from dsjax.checkpoint.save import save_model
    from dsjax.config import ModelConfig
    from dsjax.embedded import MODEL_DIR
    from dsjax.model import DeepseekV4

    root = tmp_path_factory.mktemp("compile-cache-job")
    hf = ModelConfig.preset("tiny").to_hf()
    cfg = ModelConfig.from_hf({**hf, "vocab_size": 8192, "max_position_embeddings": 4096, "num_hidden_layers": 1,
                               "layer_types": hf["layer_types"][:1], "mlp_layer_types": hf["mlp_layer_types"][:1]})
    save_model(DeepseekV4(cfg, rngs=nnx.Rngs(0)), root / "model")
    shutil.copy(os.path.join(MODEL_DIR, "tokenizer.json"), root / "model" / "tokenizer.json")
    with open(root / "in.jsonl", "w") as f:
        for i, text in enumerate(PROMPTS):
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "tiny", "messages": [{"role": "user", "content": text}],
                                         "max_tokens": 4, "temperature": 0, "thinking": {"type": "disabled"}}})
                    + "\n")
    return {"model": str(root / "model"), "input": str(root / "in.jsonl")}


@pytest.fixture(scope="module")
def cold(tmp_path_factory, tiny_job):
    """The job run once on an empty cache: its result and the cache it filled (copy it before adding)."""
    root = tmp_path_factory.mktemp("compile-cache-cold")
    out = root / "out.jsonl"
    result = _result(_generate(tiny_job, out, _env(root / "cache")), out)
    return {**result, "cache": root / "cache"}


def _warm_copy(cold, tmp_path):
    shutil.copytree(cold["cache"], tmp_path / "cache")
    return tmp_path / "cache"


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("DSJAX_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert cache_dir() == str(tmp_path / "home" / ".cache" / "dsjax")
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty, or relative (XDG says to ignore it): as if unset
    assert cache_dir() == str(tmp_path / "home" / ".cache" / "dsjax")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache_dir() == str(tmp_path / "home" / ".cache" / "dsjax")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == str(tmp_path / "xdg" / "dsjax")
    monkeypatch.setenv("DSJAX_CACHE_DIR", str(tmp_path / "own"))
    assert cache_dir() == str(tmp_path / "own")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSJAX_CACHE_DIR", "rel")  # made absolute: a later chdir does not move it
    assert cache_dir() == str(tmp_path / "rel")


def test_every_command_takes_no_compile_cache_and_generate_and_bench_take_verbose():
    parser = cli.build_parser()
    argv = {"info": ["--preset", "tiny"], "generate": ["--demo"], "convert": ["a", "b"],
            "plan": ["--preset", "tiny", "--mesh", "ep=1", "--max-len", "8", "--slots", "1"],
            "bench": ["--preset", "tiny", "--batch", "1", "--prompt-len", "4", "--gen-len", "2"],
            "export": ["--preset", "tiny", "--platform", "cpu", "--out", "x"]}
    for command, args in argv.items():
        assert parser.parse_args([command, *args]).no_compile_cache is False
        assert parser.parse_args([command, *args, "--no-compile-cache"]).no_compile_cache is True
    for command in ("generate", "bench"):
        assert parser.parse_args([command, *argv[command]]).verbose is False
        assert parser.parse_args([command, *argv[command], "-v"]).verbose is True


def test_a_command_run_in_process_leaves_jax_and_absl_as_it_found_them(monkeypatch, tmp_path, caplog):
    seen = {}

    def fake_generate(args):  # stands in for the job: what does a command run with?
        seen["dir"] = jax.config.jax_compilation_cache_dir
        seen["min_secs"] = jax.config.jax_persistent_cache_min_compile_time_secs
        seen["cpp_level"] = os.environ.get("TF_CPP_MIN_LOG_LEVEL")  # what the GPU plugin reads
        absl_logging.warning("a notice from absl")
        absl_logging.error("an error from absl")
        return 0

    monkeypatch.setattr(cli, "_generate", fake_generate)
    monkeypatch.setenv("DSJAX_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
              jax.config.jax_compilation_cache_max_size, absl_logging.get_verbosity())
    assert cli.main(["generate", "--demo"]) == 0
    assert seen == {"dir": str(tmp_path / "c" / "jax"), "min_secs": 0, "cpp_level": "2"}  # XLA's warnings hidden
    assert "an error from absl" in caplog.text and "a notice from absl" not in caplog.text
    caplog.clear()
    assert cli.main(["generate", "--demo", "-v", "--no-compile-cache"]) == 0
    assert seen == {"dir": None, "min_secs": 1.0, "cpp_level": None}  # jax's defaults: no persistent cache
    assert "a notice from absl" in caplog.text
    assert (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs,
            jax.config.jax_compilation_cache_max_size, absl_logging.get_verbosity()) == before
    assert "TF_CPP_MIN_LOG_LEVEL" not in os.environ


def test_a_second_run_loads_every_program_from_the_cache(cold, tiny_job, tmp_path):
    assert cold["programs_compiled"] > 10 and cold["programs_from_cache"] == 0
    assert len(_entries(cold["cache"])) == cold["programs_compiled"]
    assert (cold["cache"] / "jax" / ".lockfile").exists()  # jax locks it: a max size is set
    out = tmp_path / "warm.jsonl"
    stored = os.listdir(cold["cache"] / "programs")  # the engine's programs, whole
    assert cold["programs_loaded"] == 0 and len(stored) == 2 + 1 + 6  # cache, decode, the one prefill bucket, 6 samplers
    warm = _result(_generate(tiny_job, out, _env(_warm_copy(cold, tmp_path))), out)
    # The engine's programs load whole, without tracing; the few others (loading weights) from jax's cache.
    assert warm["programs_loaded"] == len(stored)
    assert warm["programs_from_cache"] == warm["programs_compiled"] < cold["programs_compiled"]
    assert warm["answers"] == cold["answers"]
    assert f"{warm['programs_from_cache']} from the cache; {len(stored)} loaded whole" in warm["stdout"]


def test_a_changed_config_compiles_its_programs_anew(cold, tiny_job, tmp_path):
    """The same weights with another routed-expert scale in config.json: every program that runs the
    model differs (the scale is a constant in it), so jax's key misses for those; the rest still hit."""
    model = tmp_path / "model"
    shutil.copytree(tiny_job["model"], model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["routed_scaling_factor"] = 2.0
    (model / "config.json").write_text(json.dumps(cfg))
    cache = _warm_copy(cold, tmp_path)
    before = set(_entries(cache))
    out = tmp_path / "changed.jsonl"
    changed = _result(_generate({**tiny_job, "model": str(model)}, out, _env(cache)), out)
    assert changed["programs_loaded"] == 6  # the samplers: the other programs' keys hold the config
    assert 0 < changed["programs_from_cache"] < changed["programs_compiled"]
    new = set(_entries(cache)) - before  # each program compiled is added
    assert len(new) == changed["programs_compiled"] - changed["programs_from_cache"]
    assert any("decode" in name for name in new) and any("prefill" in name for name in new)  # the main steps


def test_a_command_loads_what_the_same_job_compiled_in_a_python_process(tiny_job, tmp_path):
    """A notebook's `run_job` with dsjax's cache on, then the same job as a command on this CPU machine: the
    command compiles nothing. (float32 commands add two GPU-only XLA flags, and the flags are part of jax's
    key: where no GPU can run they are left out, else no program of a command matched one compiled without
    them.)"""
    from dsjax.batch.job import JobConfig, run_job
    from dsjax.compile_cache import compile_cache
    from dsjax.run_config import RunConfig

    cache = tmp_path / "cache"
    jax.clear_caches()  # as in a fresh notebook: this process compiles (and so stores) every program the job runs
    with compile_cache(str(cache)):
        first = run_job(JobConfig(model=tiny_job["model"], input=tiny_job["input"], output=str(tmp_path / "lib.jsonl"),
                                  run=RunConfig(slots=2, max_len=64, chunk_size=16, dtype="float32"),
                                  served_model_names=("tiny",), progress=False))
    assert first["programs_compiled"] > 10 and first["programs_from_cache"] == 0
    out = tmp_path / "command.jsonl"
    command = _result(_generate(tiny_job, out, _env(cache)), out)
    assert command["programs_loaded"] == len(os.listdir(cache / "programs")) > 0
    assert command["programs_from_cache"] == command["programs_compiled"]
    with open(tmp_path / "lib.jsonl") as f:
        assert {r["custom_id"]: parsed_response(r["response"]["body"]) for r in map(json.loads, f)} == {
            cid: answer for cid, (answer, _) in command["answers"].items()}


@pytest.mark.parametrize("platforms, plugins, gpu", [
    ("cpu", ["xla_cuda12 jax_plugins.xla_cuda12"], False), ("cuda", [], True), ("cpu,cuda", [], True),
    ("ROCM", [], True), ("tpu", [], False), ("", ["xla_cuda12 jax_plugins.xla_cuda12"], True),
    (None, ["jax_plugins.xla_rocm7"], True), (None, ["xla_tpu"], False), ("", [], False)])
def test_a_gpu_may_run_where_jax_platforms_names_one_or_else_a_gpu_plugin_is_installed(platforms, plugins, gpu):
    assert may_use_a_gpu(platforms, plugins) is gpu


@pytest.mark.parametrize("platforms, applied", [("cpu", False), ("cuda", True)])
def test_float32_gpu_flags_are_added_only_where_a_gpu_may_run(platforms, applied):
    """In a fresh process (before any backend starts), as `dsjax generate` calls it; a flag the user set
    either way is kept."""
    code = ("import os; from dsjax.compile_cache import use_float32_gpu_flags; "
            "print(use_float32_gpu_flags(), os.environ['XLA_FLAGS'])")
    env = {**os.environ, "JAX_PLATFORMS": platforms, "XLA_FLAGS": "--xla_gpu_autotune_level=2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    want = "--xla_gpu_autotune_level=2" + (" --xla_gpu_enable_triton_gemm=false" if applied else "")
    assert done.stdout.strip() == f"{applied} {want}"


def test_two_processes_share_one_empty_cache_then_a_third_loads_from_it(tiny_job, tmp_path):
    env = _env(tmp_path / "cache")
    outs = [tmp_path / f"p{i}.jsonl" for i in range(3)]
    procs = [_generate(tiny_job, out, env) for out in outs[:2]]  # started together, racing for every entry
    first, second = (_result(p, out) for p, out in zip(procs, outs))
    print(f"racing runs: {first['programs_from_cache']} and {second['programs_from_cache']} of "
          f"{first['programs_compiled']} programs from the cache")
    assert first["answers"] == second["answers"]
    third = _result(_generate(tiny_job, outs[2], env), outs[2])
    assert third["programs_from_cache"] == third["programs_compiled"] and third["programs_loaded"] == 9
    assert third["answers"] == first["answers"]


def test_no_compile_cache_writes_nothing(tiny_job, tmp_path):
    """Neither the folder DSJAX_CACHE_DIR names nor the fallbacks (XDG_CACHE_HOME, the home folder) appear."""
    out = tmp_path / "out.jsonl"
    env = _env(tmp_path / "absent", XDG_CACHE_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path / "home"))
    result = _result(_generate(tiny_job, out, env, "--no-compile-cache"), out)
    assert result["programs_from_cache"] == result["programs_loaded"] == 0
    assert all(name.startswith("out.") for name in os.listdir(tmp_path)), os.listdir(tmp_path)  # the job's own


def test_no_compile_cache_in_process_touches_no_fallback_folder(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("DSJAX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cli.main(["info", "--preset", "tiny", "--no-compile-cache"]) == 0
    assert os.listdir(tmp_path) == []
    assert cli.main(["info", "--preset", "tiny"]) == 0  # without the flag: XDG's folder
    assert os.path.isdir(tmp_path / "xdg" / "dsjax" / "jax") and not os.path.exists(tmp_path / "home")


def test_an_unusable_cache_folder_turns_the_cache_off_with_one_line(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    before = jax.config.jax_compilation_cache_dir
    with pytest.raises(OSError, match=f"cannot use {tmp_path / 'file' / 'c' / 'jax'} as the compile cache"):
        enable_compile_cache(str(tmp_path / "file" / "c"))
    assert jax.config.jax_compilation_cache_dir == before
    done = _finished(_dsjax("info", "--preset", "tiny", env=_env(tmp_path / "file" / "c")))
    assert done.returncode == 0 and "total" in done.stdout
    lines = [line for line in done.stderr.splitlines() if "compile cache off" in line]
    assert len(lines) == 1 and lines[0].startswith("dsjax: compile cache off: cannot use"), done.stderr


@pytest.mark.heavy
def test_the_demo_starts_at_least_twice_as_fast_the_second_time(tmp_path):
    """The acceptance check of compiling once per machine, on CPU: the demo's second run, in a fresh
    process on the cache the first filled, takes at most about half its wall time, with the same answers."""
    env = _env(tmp_path / "cache")
    env.pop("XLA_FLAGS", None)  # as a user runs it (the tests' flags make compiling cheaper)
    walls, answers = [], []
    for run in ("first", "second"):
        out = tmp_path / f"{run}.jsonl"
        start = time.perf_counter()
        done = _finished(_dsjax("generate", "--demo", "--quiet", "--output", str(out), env=env))
        walls.append(time.perf_counter() - start)
        assert done.returncode == 0, done.stderr[-3000:]
        check_demo_prints_parsed_code_and_writes_every_response(done, out)  # test_demo.py's checks of a run
        with open(out) as f:
            answers.append({r["custom_id"]: parsed_response(r["response"]["body"]) for r in map(json.loads, f)})
    print(f"demo wall: first {walls[0]:.1f} s, second {walls[1]:.1f} s ({walls[1] / walls[0]:.2f})")
    assert answers[0] == answers[1] and len(answers[0]) == 9
    assert walls[1] / walls[0] <= 0.6, walls
