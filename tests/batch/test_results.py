"""The output file: appended records, resume after a crash, torn-line repair."""

import json

import pytest

from dsjax.batch.jobfile import ErrorInfo, InputLine, JobError
from dsjax.batch.results import ResultsFile, error_record, success_record


def line(n, cid, occurrence=1):
    return InputLine(n, cid, "/v1/chat/completions", {}, occurrence=occurrence)


def test_records_resume_and_torn_line_repair(tmp_path):
    path = str(tmp_path / "out.jsonl")
    a, b, dup, anon = line(1, "a"), line(2, "b"), line(3, "a", 2), InputLine(4, None, None, None)
    with ResultsFile(path) as out:
        out.write(error_record(dup, ErrorInfo("duplicate_custom_id", "x")))  # written before "a" finishes
        out.write(success_record(a, {"ok": 1}))
        out.write(error_record(anon, ErrorInfo("invalid_json", "line 4: bad")))
    with open(path, "ab") as f:
        f.write(b'{"id": "batch_req_x", "custom_id": "b", "resp')  # killed mid-write
    out = ResultsFile(path)
    assert out.repaired_bytes > 0
    assert [out.is_done(x) for x in (a, b, dup, anon)] == [True, False, True, True]
    out.write(success_record(b, {"ok": 2}))
    out.close()
    recs = [json.loads(x) for x in open(path)]
    assert [r["custom_id"] for r in recs] == ["a", "a", None, "b"]
    assert recs[0]["error"]["code"] == "duplicate_custom_id" and recs[0]["line"] == 3
    assert recs[1]["response"]["status_code"] == 200 and recs[1]["error"] is None
    assert recs[2]["line"] == 4


def test_foreign_output_is_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("hello\n{}\n")
    with pytest.raises(JobError, match="not an output of this job"):
        ResultsFile(str(path))


def test_missing_output_folder_fails_fast(tmp_path):
    with pytest.raises(JobError, match="does not exist"):
        ResultsFile(str(tmp_path / "nope" / "out.jsonl"))
