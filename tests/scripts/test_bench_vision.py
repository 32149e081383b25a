"""`scripts/bench_vision.py` on the tiny V4.1 encoder: a row per size, attention and batch (all agree), and
bad arguments refused before anything runs."""

import importlib.util
import json
from pathlib import Path

import jax

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_vision.py"
spec = importlib.util.spec_from_file_location("bench_vision", SCRIPT)
bench_vision = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_vision)


def test_rows_per_size_attention_and_batch(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    args = ["--preset", "tiny-v4.1-vision", "--sizes", "126x84", "546x252", "--attention", "64", "0",
            "--batch", "1", "3", "--repeats", "1", "--dtype", "float32", "--json", str(out)]
    assert bench_vision.main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["size"], r["attention"], r["batch"]) for r in rows] == [
        (s, a, b) for s in ("126x84", "546x252") for a in ("blocks of 64", "dense") for b in (1, 3)]
    for r in rows:
        assert r["padded_patches"] >= r["patches"] > 0 and r["ms"] > 0 and r["tflop"] > 0
        assert r["ms"] == r["ms_per_call"] / r["batch"]
        assert r["max_rel_diff"] < 1e-5
    assert rows[4]["image_tokens"] == 6 * (13 + 1) + 2  # 546x252: 6 rows of 13 cells
    assert rows[4]["temp_bytes"] < rows[6]["temp_bytes"]  # blocks of 64 queries against all 702+ at once
    assert capsys.readouterr().out.splitlines()[-1].startswith("546x252 | 702 (")


def test_bad_arguments_are_refused(capsys):
    assert bench_vision.main(["--preset", "tiny-v4.1-vision", "--sizes", "100x84"]) == 2
    assert "--sizes 100x84: must be WxH, both positive multiples of 14" in capsys.readouterr().err
    assert bench_vision.main(["--preset", "tiny-v4.1", "--sizes", "84x84"]) == 2
    assert "has no image encoder" in capsys.readouterr().err
    assert bench_vision.main(["--preset", "tiny-vision"]) == 2
    assert "--preset tiny-vision" in capsys.readouterr().err
    assert bench_vision.main(["--preset", "tiny-v4.1-vision", "--attention", "flash"]) == 2
    assert "--attention flash: must be 'fused' or a number" in capsys.readouterr().err
    assert bench_vision.main(["--preset", "tiny-v4.1-vision", "--batch", "0"]) == 2
    assert "--batch must be positive" in capsys.readouterr().err
    if jax.default_backend() != "gpu":
        assert bench_vision.main(["--preset", "tiny-v4.1-vision", "--attention", "fused"]) == 2
        assert "cuDNN's fused attention needs an NVIDIA GPU" in capsys.readouterr().err
