"""The `dsjax` command's run options: one flag per `RunConfig` field, the same name and choices in every
sub-command, old spellings that still work with a line naming the new one, and bad values refused with
one line that names the flag."""

import argparse
import dataclasses
import json
import warnings

import pytest

from dsjax.cli import build_parser, main, run_config
from dsjax.quant import KV_DTYPES
from dsjax.run_config import DECODER_PREFILL, DTYPES, KERNELS, SPECULATIVE, WEIGHTS, RunConfig

FLAGS = {"slots": "--slots", "max_len": "--max-len", "chunk_size": "--chunk-size", "dtype": "--dtype",
         "kv_dtype": "--kv-dtype", "weights": "--weights", "kernels": "--kernels", "mesh": "--mesh",
         "decoder_prefill": "--decoder-prefill", "speculative": "--speculative", "drafts": "--drafts",
         "batch_invariant": "--batch-invariant"}
CHOICES = {"dtype": DTYPES, "kv_dtype": KV_DTYPES, "weights": WEIGHTS, "kernels": KERNELS,
           "decoder_prefill": DECODER_PREFILL, "speculative": SPECULATIVE}
# The run options each sub-command takes: those it uses (V4.1's decoder prefill and speculative decoding where the
# scheduler runs).
SCHEDULED = {"decoder_prefill", "speculative", "drafts", "batch_invariant"}
EVERY = set(FLAGS) - SCHEDULED
TAKES = {"info": {"max_len"}, "generate": EVERY | SCHEDULED, "convert": {"weights", "mesh"}, "plan": EVERY,
         "bench": EVERY - {"max_len", "dtype"} | SCHEDULED, "export": EVERY}
# Enough for each sub-command to parse (values of its own required options).
BASE = {"info": ["--preset", "tiny"], "generate": [], "convert": ["src", "dst"],
        "plan": ["--preset", "tiny", "--mesh", "ep=8", "--max-len", "64", "--slots", "8"],
        "bench": ["--preset", "tiny", "--slots", "2", "--prompt-len", "4", "--gen-len", "2"],
        "export": ["--preset", "tiny", "--platform", "cpu", "--out", "out"]}


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def _parse(argv):
    return build_parser().parse_args(argv)


def test_every_subcommand_spells_the_run_options_alike():
    commands = _subcommands()
    assert set(commands) == set(TAKES)
    for name, parser in commands.items():
        shown = [a for a in parser._actions if a.dest in FLAGS and a.help != argparse.SUPPRESS]
        assert {a.dest for a in shown} == TAKES[name], name
        for action in shown:
            assert action.option_strings == [FLAGS[action.dest]], (name, action.option_strings)
            if action.dest in CHOICES:  # the code's own tuples, not a copy
                assert action.choices is CHOICES[action.dest], (name, action.dest)
        others = {s for a in parser._actions if a.dest not in FLAGS for s in a.option_strings}
        assert not others & set(FLAGS.values()), name


@pytest.mark.parametrize("command", ["generate", "plan", "export"])
def test_the_parsed_run_config_is_the_flags(command):
    argv = [*BASE[command], "--slots", "16", "--max-len", "64", "--chunk-size", "16", "--dtype", "float32",
            "--kv-dtype", "fp8", "--weights", "bf16", "--kernels", "reference", "--mesh", "dp=2,ep=4"]
    assert run_config(_parse([command, *argv])) == RunConfig(
        slots=16, max_len=64, chunk_size=16, dtype="float32", kv_dtype="fp8", weights="bf16", kernels="reference",
        mesh="dp=2,ep=4")


@pytest.mark.parametrize("command", ["generate", "plan", "export", "bench"])
def test_chunk_size_auto_is_resolved_for_the_platform(command, monkeypatch):
    """`--chunk-size auto` becomes `auto_chunk_size`'s number for the run's slots and max_len on the
    backend JAX runs on: 256 on the CPU; on an accelerator what the rule gives (8 slots: 8,192)."""
    import jax

    argv = [*BASE[command], "--chunk-size", "auto", "--slots", "8"]
    if command != "bench":
        argv += ["--max-len", "100000"]
    assert run_config(_parse([command, *argv]), slots=8).chunk_size == 256
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert run_config(_parse([command, *argv]), slots=8, max_len=100000).chunk_size == 8192
    assert run_config(_parse([command, *argv]), slots=128, max_len=100000).chunk_size == 512


def test_defaults_are_run_configs_but_where_a_command_differs():
    assert run_config(_parse(["generate"])) == RunConfig()
    assert run_config(_parse(["export", *BASE["export"]])) == RunConfig()
    plan = run_config(_parse(["plan", *BASE["plan"]]))
    assert plan == RunConfig(slots=8, max_len=64, mesh="ep=8")
    # bench measures float weights unless told (its numbers compare with float engines)
    args = _parse(["bench", *BASE["bench"], "--slots", "32", "128"])
    assert args.slots == [32, 128] and run_config(args, slots=32).weights == "bf16"
    assert _parse(["convert", "src", "dst"]).weights == "keep"
    assert _parse(["info", "--preset", "tiny"]).max_len is None  # the model's own context


def test_info_sizes_the_cache_at_max_len(capsys):
    assert main(["info", "--preset", "tiny", "--max-len", "64"]) == 0
    assert "cache per token of context at 64 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("argv,field,value,old,new", [
    (["generate", "--max-batch", "3"], "slots", 3, "--max-batch", "--slots"),
    (["bench", "--preset", "v4-flash", "--layers", "4", "--batch", "32", "128", "--prompt-len", "512", "--gen-len",
      "64"], "slots", [32, 128], "--batch", "--slots"),
    (["export", *BASE["export"], "--chunk", "16"], "chunk_size", 16, "--chunk", "--chunk-size"),
    (["info", "--preset", "tiny", "--context", "99"], "max_len", 99, "--context", "--max-len"),
    (["plan", *BASE["plan"], "--weights", "fp8"], "weights", "keep", "--weights fp8", "--weights keep"),
    (["bench", *BASE["bench"], "--weights", "fp8"], "weights", "keep", "--weights fp8", "--weights keep"),
    (["export", *BASE["export"], "--weights", "fp8"], "weights", "keep", "--weights fp8", "--weights keep"),
])
def test_old_spellings_still_work_and_name_the_new_one(argv, field, value, old, new, capsys):
    args = _parse(argv)
    assert getattr(args, field) == value
    assert capsys.readouterr().err == f"dsjax: {old} is deprecated, use {new} (it goes in 0.2)\n"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # RunConfig's own notice would be a second message
        run = run_config(args, **({"slots": max(args.slots)} if argv[0] == "bench" else {}))
    assert getattr(run, field) == (max(value) if isinstance(value, list) else value)


def test_new_and_old_spelling_together_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["bench", *BASE["bench"], "--batch", "4"])
    assert e.value.code == 2 and "argument --batch: not allowed with argument --slots" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["bench", "--preset", "tiny", "--prompt-len", "4", "--gen-len", "2"])
    assert "--slots is required" in capsys.readouterr().err


@pytest.mark.parametrize("command,flag,bad", [
    (command, FLAGS[field], "int4") for command in TAKES for field in sorted(TAKES[command]) if field in CHOICES
] + [(command, "--slots", "x") for command in ("generate", "plan", "export", "bench")]
  + [(command, "--chunk-size", "big") for command in ("generate", "plan", "export", "bench")])
def test_a_value_argparse_cannot_read_is_its_error(command, flag, bad, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, *BASE[command], flag, bad])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"dsjax {command}: error: argument {flag}" in err and bad in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command,flag,bad,message", [
    ("generate", "--slots", "0", "--slots must be an integer of at least 1, got 0"),
    ("generate", "--max-len", "1", "--max-len must be an integer of at least 2, got 1"),
    ("generate", "--mesh", "ep=two", "--mesh 'ep=two': expected comma-separated AXIS=SIZE"),
    ("convert", "--mesh", "xp=2", "--mesh 'xp=2': expected comma-separated AXIS=SIZE"),
    ("plan", "--max-len", "0", "--max-len must be an integer of at least 2, got 0"),
    ("plan", "--chunk-size", "0", "--chunk-size must be an integer of at least 1, got 0"),
    ("export", "--slots", "-1", "--slots must be an integer of at least 1, got -1"),
    ("export", "--mesh", "ep=2,ep=2", "--mesh 'ep=2,ep=2': axis 'ep' given twice"),
    ("bench", "--slots", "0", "--slots must be an integer of at least 1, got 0"),
    ("bench", "--chunk-size", "0", "--chunk-size must be an integer of at least 1, got 0"),
    ("info", "--max-len", "1", "--max-len must be an integer of at least 2, got 1"),
])
def test_a_value_run_config_refuses_is_one_line_naming_the_flag(command, flag, bad, message, capsys, tmp_path):
    argv = [*BASE[command], flag, bad]
    if command == "export":
        argv[argv.index("--out") + 1] = str(tmp_path / "out")
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dsjax {command}: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_bench_runs_each_slot_count(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert main(["bench", "--preset", "tiny", "--layers", "1", "--slots", "1", "2", "--prompt-len", "6",
                 "--gen-len", "2", "--chunk-size", "8", "--weights", "keep", "--copy-tbps", "1",
                 "--matmul-tflops", "100", "--no-breakdown", "--json", str(out)]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["batch"] for r in rows] == [1, 2]
    assert "keep weights" in capsys.readouterr().out


def test_run_options_have_one_name_in_the_config_and_the_cli():
    assert [f.name for f in dataclasses.fields(RunConfig)] == list(FLAGS)


def test_drafts_take_a_count_or_auto():
    from dsjax.cli import _drafts

    assert _drafts("auto") is None and _drafts("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="number of drafts or 'auto'"):
        _drafts("many")


def test_drafts_without_speculative_decoding_name_both_flags(capsys):
    assert main(["generate", "--model", "m", "--input", "i.jsonl", "--output", "o.jsonl", "--drafts", "2"]) == 2
    assert "--drafts 2 needs speculative decoding" in capsys.readouterr().err
