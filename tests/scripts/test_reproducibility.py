"""scripts/reproducibility.py on the embedded model: the batch-invariant mode holds, and the report says so."""

import importlib.util
import json
from pathlib import Path

import pytest

from dsjax.embedded import MODEL_DIR

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reproducibility.py"
spec = importlib.util.spec_from_file_location("reproducibility", SCRIPT)
rep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rep)


@pytest.mark.heavy
def test_a_job_run_twice_and_resumed_after_sigkill_is_the_same_with_the_batch_invariant_mode(tmp_path, capsys):
    assert rep.main(["determinism", "--model", MODEL_DIR, "--work", str(tmp_path), "--count", "12", "--slots",
                     "4", "--max-tokens", "8", "--modes", "batch-invariant"]) == 0
    out = capsys.readouterr().out
    assert "| default" not in out  # only the mode asked for ran
    rows = [line for line in out.splitlines() if line.startswith("| batch-invariant")]
    assert rows and rows[0].split("|")[2].strip() == "yes" and rows[0].split("|")[4].strip() == "yes"
    requests = [json.loads(line) for line in open(tmp_path / "in.jsonl")]
    assert len(requests) == 12 and {r["body"]["temperature"] for r in requests} == {0.7}
    assert sum("seed" in r["body"] for r in requests) == 6  # half seeded, half drawn from the job's seed


@pytest.mark.parametrize("modes", ["", "fast", "default,fast"])
def test_unknown_modes_are_refused_by_name(modes, capsys):
    with pytest.raises(SystemExit):
        rep.main(["invariance", "--model", MODEL_DIR, "--modes", modes])
    assert "modes must be some of default, batch-invariant" in capsys.readouterr().err
