"""`scripts/structured_outputs.py`: every kind of format through the real job on the embedded model; each
constrained output validates, and the check it counts with refuses what does not."""

import importlib.util
import json
from pathlib import Path

from dsjax.embedded import MODEL_DIR

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "structured_outputs.py"
spec = importlib.util.spec_from_file_location("structured_outputs", SCRIPT)
so = importlib.util.module_from_spec(spec)
spec.loader.exec_module(so)


def test_the_cases_cover_every_shape_and_the_check_refuses_what_does_not_match():
    cases = so.cases(len(so.SCHEMAS) + len(so.REGEXES) + 1)
    assert [c["kind"] for c in cases].count("json") == len(so.SCHEMAS) and any(c["think"] for c in cases)
    assert not any(c["think"] for c in so.cases(20, think_every=0))
    person = cases[0]
    assert so.valid(person, '{"name": "Ada", "age": 36}')
    for bad in ('{"name": "Ada"}', '{"name": "Ada", "age": 36, "x": 1}', '{"name": "Ada", "age": 300}', "not json",
                None):
        assert not so.valid(person, bad)
    choice = cases[-1]
    assert so.valid(choice, "yes") and not so.valid(choice, "yes!")


def test_every_constrained_output_validates(tmp_path):
    count = len(so.SCHEMAS) + len(so.REGEXES) + 1
    # Without thinking (tests/engine/test_constrained.py has a format after the thinking part): a tiny model can
    # think past any short budget.
    assert so.main(["--model", MODEL_DIR, "--out", str(tmp_path), "--count", str(count), "--slots", "4",
                    "--max-len", "512", "--think-every", "0"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["constrained"]["valid"] == count and report["constrained"]["errors"] == 0
    assert report["free"]["errors"] == 0 and 0 <= report["free"]["valid"] <= count
