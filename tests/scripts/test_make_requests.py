"""`scripts/make_requests.py`: N distinct chat requests the batch job takes."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_requests.py"
spec = importlib.util.spec_from_file_location("make_requests", SCRIPT)
make = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make)


def test_requests_are_distinct_valid_lines(tmp_path):
    from dsjax.batch.jobfile import read_lines

    out = tmp_path / "in.jsonl"
    assert make.main([str(out), "--count", "20", "--model", "m", "--words", "10", "--max-tokens", "3"]) == 0
    lines = list(read_lines(str(out)))
    assert len(lines) == 20 and all(x.error is None and x.body["model"] == "m" for x in lines)
    assert len({json.dumps(x.body["messages"]) for x in lines}) == 20
    with pytest.raises(SystemExit):
        make.main([str(out), "--count", "0"])
