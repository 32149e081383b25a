"""`scripts/bench_speculative.py`: a verification step's time against a plain decode step, one row per width."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_speculative.py"
spec = importlib.util.spec_from_file_location("bench_speculative", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_rows_per_width_against_the_plain_step(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert bench.main(["--preset", "tiny-v4.1", "--layers", "0,2", "--engram-rows", "1000", "--slots", "2",
                       "--context", "9", "--widths", "1", "3", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["width"], r["drafts"]) for r in rows] == [(1, 0), (3, 2)]
    assert rows[0]["of_plain"] == 1.0 and rows[1]["step_ms"] > 0 and rows[1]["of_plain"] > 0
    with pytest.raises(SystemExit, match="start with 1"):
        bench.main(["--preset", "tiny-v4.1", "--layers", "0,2", "--widths", "2", "3"])


def test_the_drafters_own_step_is_timed(tmp_path):
    from dsjax.bench import bench_config
    from tests.helpers import dspark_model

    rows = []
    bench.measure_drafter(dspark_model(0), 2, 9, rows.append)
    assert [r["part"] for r in rows] == ["propose", "write_context"] and all(r["step_ms"] > 0 for r in rows)
    cfg = bench.with_drafter(bench_config("v4.1-flash", [0, 1, 2, 3, 20, 21], "keep"), "v4.1-flash")
    assert cfg.num_nextn_predict_layers == 3 and cfg.dspark_target_layer_ids == (3, 4, 5)
    assert len(cfg.compress_ratios) == 9
    with pytest.raises(SystemExit, match="no DSpark stages"):
        bench.main(["--preset", "tiny-v4.1", "--layers", "0,2", "--drafter"])
