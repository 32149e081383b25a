"""scripts/train_tiny.py end to end on the tiny preset and a small saved corpus: a time budget ends training and
the metrics count the tokens it saw; bad budgets are refused before anything trains."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import train_tiny  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("corpus") / "corpus.npz"
    np.savez(path, train=rng.integers(3, 500, (16, 32)).astype(np.uint16),
             heldout=rng.integers(3, 500, (2, 32)).astype(np.uint16), stats=json.dumps({"rows_train": 16}))
    return path


def test_a_time_budget_stops_training_and_the_metrics_count_what_was_seen(tmp_path, corpus):
    out = tmp_path / "model"
    assert train_tiny.main(["--preset", "tiny", "--out", str(out), "--corpus", str(corpus), "--seq-len", "32",
                            "--steps", "500", "--eval-every", "100", "--batch-size", "2", "--time-budget", "1e-3"]) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    steps = [e for e in log if "step" in e]
    assert [e["step"] for e in steps] == [11] and steps[0]["planned_steps"] == 11
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_tokens"] == 11 * 2 * 32 == steps[0]["tokens"]
    assert "--time-budget 1e-3" in metrics["command"]


@pytest.mark.parametrize("argv, message", [
    (["--time-budget", "0"], "--time-budget must be a positive number of seconds"),
    (["--drafter-time-budget", "-5"], "--drafter-time-budget must be a positive"),
    (["--target", "somewhere", "--drafter-steps", "3", "--time-budget", "10"], "which --target skips"),
])
def test_bad_budgets_are_refused_by_name(tmp_path, corpus, capsys, argv, message):
    preset = ["--preset", "demo-v4.1"] if "--target" in argv else ["--preset", "tiny"]  # demo-v4.1 has DSpark stages
    with pytest.raises(SystemExit):
        train_tiny.main([*preset, "--out", str(tmp_path / "m"), "--corpus", str(corpus), *argv])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_a_run_without_measuring_then_measured_gives_the_measured_runs_figures(tmp_path, corpus):
    base = ["--preset", "tiny", "--corpus", str(corpus), "--seq-len", "32", "--steps", "3", "--eval-every", "3",
            "--batch-size", "2"]
    assert train_tiny.main([*base, "--out", str(tmp_path / "a")]) == 0
    assert train_tiny.main([*base, "--out", str(tmp_path / "b"), "--no-measure"]) == 0
    unmeasured = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert "heldout_ce_training_code" not in unmeasured and unmeasured["train_tokens"] == 3 * 2 * 32
    assert train_tiny.main(["--measure", str(tmp_path / "b")]) == 0
    a = json.loads((tmp_path / "a" / "metrics.json").read_text())
    b = json.loads((tmp_path / "b" / "metrics.json").read_text())
    figures = [k for k in a if k.startswith("heldout") or k == "inference_path_prefill_tokens"]
    assert len(figures) == 5 and {k: a[k] for k in figures} == {k: b[k] for k in figures}
    assert b["command"] == unmeasured["command"] and b["measure_command"].endswith(f"--measure {tmp_path / 'b'}")
    log = [json.loads(line) for line in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["final"] == b


def test_measure_refuses_a_folder_without_a_run_and_a_mix_of_options(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no readable metrics.json"):
        train_tiny.main(["--measure", str(tmp_path)])
    with pytest.raises(SystemExit):
        train_tiny.main(["--measure", str(tmp_path), "--out", str(tmp_path / "m")])
    assert "give neither --out nor --no-measure" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_tiny.main(["--preset", "tiny"])
    assert "--out is required" in capsys.readouterr().err
