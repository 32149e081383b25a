"""`scripts/bench_multigpu.py` end to end on the 8 test CPU devices: a tiny synthetic checkpoint,
converted for ep=8, loaded one slice per device, decoded through the engine on the mesh, with
`dsjax plan`'s prediction beside it; a second run resumes from the checkpoints it finds."""

import importlib.util
import json
import re
from pathlib import Path

import jax
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_multigpu.py"
spec = importlib.util.spec_from_file_location("bench_multigpu", SCRIPT)
multigpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(multigpu)

ARGS = ["--preset", "tiny", "--layers", "2", "--prompt-len", "12", "--gen-len", "3", "--chunk-size", "8",
        "--collective-mib", "0.25"]


@pytest.mark.heavy
def test_runs_and_resumes(tmp_path, capsys):
    work = tmp_path / "run"
    assert multigpu.main([str(work), "--per-device", "1", *ARGS]) == 0
    first = capsys.readouterr().out
    assert "[synthetic checkpoint]" in first and "already there" not in first
    assert multigpu.main([str(work), "--per-device", "2", *ARGS]) == 0
    second = capsys.readouterr().out
    assert second.count("already there, skipped") == 2  # the checkpoint and its conversion
    rows = [json.loads(line) for line in (work / "rows.jsonl").read_text().splitlines()]
    assert [r["per_device"] for r in rows] == [1, 2] and [r["batch"] for r in rows] == [8, 16]
    for r in rows:
        assert r["mesh"] == {"dp": 1, "ep": 8, "tp": 1} and r["weights"] == "keep"
        assert r["compilations_after_warmup"] == 0 and r["decode_tokens_per_s"] > 0
        assert r["planned_bytes_per_device"] >= r["planned_weights"] + r["planned_cache"] > 0
        assert set(r["exchange_bytes_per_step"]) == {"gathered", "ragged_mean", "ragged_max"}
        assert r["collective_rates"]["all_to_all"] > 0 and r["collective_rates"]["all_gather"] > 0
    assert rows[1]["planned_cache"] == pytest.approx(2 * rows[0]["planned_cache"], rel=0.1)
    assert "per device | tok/s" in second
    with open(work / "rows.jsonl", "a") as f:
        f.write('{"per_device": 4, "model"')  # a run killed mid-write
    lines = (work / "rows.jsonl").read_text().splitlines()
    assert multigpu.main([str(work), "--per-device", "1", "2", *ARGS]) == 0  # both measured: nothing runs again
    third = capsys.readouterr().out
    assert third.count("per device] already in") == 2
    assert (work / "rows.jsonl").read_text().splitlines() == lines
    assert third.splitlines()[-3:] == first.splitlines()[-2:] + second.splitlines()[-1:]  # the table, as measured
    # Other settings are measured anew. These keep the slots' length (13 + 2 = 12 + 3 tokens), so the
    # engine loads the first run's programs from the program store instead of compiling its own.
    assert multigpu.main([str(work), "--per-device", "1", *ARGS, "--prompt-len", "13", "--gen-len", "2"]) == 0
    last = (work / "rows.jsonl").read_text().splitlines()
    assert last[:-1] == lines and (json.loads(last[-1])["prompt_len"], json.loads(last[-1])["gen_len"]) == (13, 2)

    # The token check: the mesh's greedy tokens are one device's (float32, as on the CPU mesh tests).
    check = ["--check-sequences", "8", "--check-prompt-len", "5", "--check-gen-len", "6", "--check-dtype", "float32"]
    assert multigpu.main([str(work), "--per-device", "1", *ARGS, *check]) == 0
    out = capsys.readouterr().out
    assert "8/8 sequences and 48/48 tokens equal" in out, out[-2000:]
    got = json.loads((work / "tokens.json").read_text())
    assert got["partings"] == [] and got["max_logprob_diff"] < 1e-3 and got["dtype"] == "float32"
    assert multigpu.main([str(work), "--per-device", "1", *ARGS, *check]) == 0
    assert "[tokens] already in" in capsys.readouterr().out


def test_token_check_reports_where_sequences_part():
    """Against other weights, sequences part: each parting is named with its step and the one-device
    margin between the top two choices there (non-negative). (Against the same weights every token is
    equal: `test_runs_and_resumes`.)"""
    import jax.numpy as jnp
    from flax import nnx

    import dsjax
    from dsjax.config import ModelConfig
    from dsjax.parallel.mesh import make_mesh
    from dsjax.parallel.shard import shard_model

    cfg = ModelConfig.preset("tiny")
    mesh = make_mesh("ep=8")
    model = shard_model(dsjax.DeepseekV4(cfg, rngs=nnx.Rngs(1), dtype=jnp.float32), mesh)
    other = multigpu.check_tokens(model, mesh, dsjax.DeepseekV4(cfg, rngs=nnx.Rngs(2), dtype=jnp.float32), 8, 4, 5)
    assert other["equal_sequences"] == 8 - len(other["partings"]) < 8
    assert other["equal_tokens"] == sum(p["step"] for p in other["partings"]) + 5 * other["equal_sequences"]
    assert all(0 <= p["step"] < 5 and p["margin"] >= 0 for p in other["partings"])


def test_refuses_a_mesh_that_is_not_every_device(tmp_path, capsys):
    assert multigpu.main([str(tmp_path / "x"), "--ep", "3", *ARGS]) == 2
    assert f"there are {jax.device_count()}" in capsys.readouterr().err
    assert multigpu.main([str(tmp_path / "x"), "--gen-len", "1", "--preset", "tiny"]) == 2
    assert multigpu.main([str(tmp_path / "x"), "--check-sequences", "3", "--preset", "tiny"]) == 2
    assert "--check-sequences 3: must be a multiple of the 8 devices" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing written for bad input


@pytest.mark.heavy
def test_a_v41_slice_runs_with_a_job_of_mixed_lengths(tmp_path, capsys):
    """DeepSeek-V4.1 by the release's layer indices: the checkpoint, its conversion, `dsjax generate` of a
    mixed job on the mesh (in its own process, its summary kept), then the decode row; re-run, nothing again."""
    work = tmp_path / "v41"
    argv = [str(work), "--preset", "tiny-v4.1", "--layers", "0,1,2,3", "--per-device", "1", "--prompt-len", "12",
            "--gen-len", "3", "--chunk-size", "8", "--collective-mib", "0.25", "--no-breakdown",
            "--job-mix", "5:12", "60:4", "--job-slots", "8", "--job-max-len", "256", "--job-max-tokens", "4"]
    assert multigpu.main(argv) == 0
    out = capsys.readouterr().out
    summary = json.loads((work / "job" / "output.summary.json").read_text())
    assert summary["requests_ok"] == 16 and summary["requests_failed"] == 0
    assert len((work / "job" / "output.jsonl").read_text().splitlines()) == 16
    assert f"job: 16 ok, 0 failed; {summary['prompt_tokens']:,} prompt" in out
    (row,) = [json.loads(line) for line in (work / "rows.jsonl").read_text().splitlines()]
    assert row["model"] == "tiny-v4.1 (4 layers, 8 experts)" and row["mesh"]["ep"] == 8
    assert row["decode_tokens_per_s"] > 0 and row["planned_bytes_per_device"] > row["planned_weights"] > 0
    assert multigpu.main(argv) == 0
    again = capsys.readouterr().out
    assert again.count("already there, skipped") == 3 and "per device] already in" in again


def test_refuses_a_slice_whose_checkpoints_do_not_fit_the_disk(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(multigpu, "_free_bytes", lambda folder: 10 << 30)
    assert multigpu.main([str(tmp_path / "big"), "--preset", "v4.1-flash", "--layers", "all"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"the checkpoint and its conversion need 9\d\d\.\d GiB more; .* has 10\.0 GiB free", err), err
    assert not (tmp_path / "big").exists()
    with pytest.raises(SystemExit):
        multigpu.main([str(tmp_path / "big"), "--preset", "v4.1-flash", "--layers", "0,x"])
    assert "argument --layers: a count, layer indices such as 0,1,20, or all; got '0,x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a bad job is refused before anything is written
        multigpu.main([str(tmp_path / "big"), "--preset", "tiny-v4.1", "--job-mix", "5:0"])
    assert "'5:0': words and count must be positive" in capsys.readouterr().err
    assert not (tmp_path / "big").exists()
