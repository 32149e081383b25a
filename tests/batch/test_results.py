"""The output file: appended records, resume after a crash, torn-line repair."""

import json
import os
import subprocess
import sys
import time

import pytest

from dsjax.batch.jobfile import ErrorInfo, InputLine, JobError
from dsjax.batch.results import ResultsFile, error_record, fingerprint_path, lock_path, success_record


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
    assert path.read_text() == "hello\n{}\n"


def test_missing_output_folder_fails_fast(tmp_path):
    with pytest.raises(JobError, match="does not exist"):
        ResultsFile(str(tmp_path / "nope" / "out.jsonl"))


def test_output_that_is_the_input_is_refused_untouched(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"custom_id": "a"}')  # one line, no final newline
    os.symlink(inp, tmp_path / "link.jsonl")
    os.link(inp, tmp_path / "hard.jsonl")
    for out in (inp, tmp_path / "link.jsonl", tmp_path / "hard.jsonl", tmp_path / "." / "in.jsonl"):
        with pytest.raises(JobError, match="is the input file"):
            ResultsFile(str(out), str(inp))
    assert inp.read_bytes() == b'{"custom_id": "a"}'
    assert not os.path.exists(lock_path(str(inp)))


def test_only_a_recognisable_output_is_repaired(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("{}\n")
    text = tmp_path / "notes.txt"
    text.write_bytes(b"Remember to buy milk and call the plumber today.")  # 49 bytes, no newline
    for content in (b"Remember to buy milk and call the plumber today.", b"[1, 2, 3]\n", b"null\n",
                    b'{"a": 1}\n', b'{"id": "batch_req_1", "custom_id": "a", "response": null, "error": null}\n'
                    b'[1]\n{"id": "batch_req_2"'):
        text.write_bytes(content)
        with pytest.raises(JobError, match="is not an output of this job.*nothing was changed"):
            ResultsFile(str(text), str(inp))
        assert text.read_bytes() == content
    # What a crash leaves is repaired: a record cut short, or the zeros of blocks never written.
    for tail in (b'{"id": "batch_r', b'{"id": "batch_req_9", "custom_id": "b", "resp', b"\0" * 40, b"\0" * 8 + b"\n"):
        good = b'{"id": "batch_req_1", "custom_id": "a", "response": null, "error": null}\n'
        text.write_bytes(good + tail)
        with ResultsFile(str(text), str(inp)) as out:
            assert out.repaired_bytes == len(tail) and out.is_done(line(1, "a"))
        assert text.read_bytes() == good


def test_an_empty_existing_output_is_used(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("{}\n")
    out.write_bytes(b"")
    with ResultsFile(str(out), str(inp)) as f:
        assert not f.done


def test_a_second_job_on_the_same_output_is_refused_at_once(tmp_path):
    inp, out = tmp_path / "in.jsonl", str(tmp_path / "out.jsonl")
    inp.write_text("{}\n")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from dsjax.batch.results import ResultsFile; "
                               f"f = ResultsFile({out!r}, {str(inp)!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t = time.monotonic()
        with pytest.raises(JobError, match=rf"being written by another dsjax job \(pid {holder.pid} on"):
            ResultsFile(out, str(inp))
        assert time.monotonic() - t < 5
    finally:
        holder.kill()
        holder.wait()
    with ResultsFile(out, str(inp)) as f:  # the lock died with its holder
        f.write(success_record(line(1, "a"), {}))
    assert not os.path.exists(lock_path(out))
    with ResultsFile(out, str(inp)):
        with pytest.raises(JobError, match=f"pid {os.getpid()}"):  # in one process too
            ResultsFile(out, str(inp))


def test_outputs_that_are_not_regular_files_are_refused_without_blocking(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("{}\n")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    for out, why in ((fifo, "not a regular file"), ("/dev/null", "a device or a process"),
                     (tmp_path / "dir", "not a regular file")):
        with pytest.raises(JobError, match=why):
            ResultsFile(str(out), str(inp))


def test_a_changed_input_is_refused_unless_asked_for(tmp_path):
    inp, out = tmp_path / "in.jsonl", str(tmp_path / "out.jsonl")
    inp.write_text('{"custom_id": "a"}\n')
    with ResultsFile(out, str(inp)) as f:
        f.write(success_record(line(1, "a"), {}))
    fp = json.load(open(fingerprint_path(out)))
    assert fp["bytes"] == inp.stat().st_size and len(fp["sha256"]) == 64
    with ResultsFile(out, str(inp)) as f:  # unchanged: resumes
        assert f.is_done(line(1, "a")) and not f.input_changed
    inp.write_text('{"custom_id": "a"}\n{"custom_id": "b"}\n')
    with pytest.raises(JobError, match="changed since .* was started from it.*1 records written.*--allow-changed-input"):
        ResultsFile(out, str(inp))
    with ResultsFile(out, str(inp), allow_changed_input=True) as f:
        assert f.input_changed and f.is_done(line(1, "a"))
        f.open()  # the new fingerprint is written when the job starts writing
    with ResultsFile(out, str(inp)) as f:  # the fingerprint now is the new input's
        assert not f.input_changed


def test_text_that_is_not_unicode_is_written_as_escapes_and_read_back(tmp_path):
    inp, out = tmp_path / "in.jsonl", str(tmp_path / "out.jsonl")
    inp.write_text("{}\n")
    weird = line(1, "a\ud800b")
    with ResultsFile(out, str(inp)) as f:
        f.write(error_record(weird, ErrorInfo("invalid_request", "bad \udfff text")))
        f.write(success_record(line(2, "ünïcode"), {"text": "é"}))
    raw = open(out, "rb").read()
    raw.decode("utf-8")  # valid UTF-8 throughout
    assert "ünïcode".encode() in raw  # text that can be written as itself is
    with ResultsFile(out, str(inp)) as f:
        assert f.is_done(weird) and f.is_done(line(2, "ünïcode"))


def test_two_paths_to_one_output_take_one_lock(tmp_path):
    inp, out = tmp_path / "in.jsonl", str(tmp_path / "o.jsonl")
    inp.write_text("{}\n")
    os.symlink("o.jsonl", tmp_path / "alias.jsonl")
    with ResultsFile(out, str(inp)):
        with pytest.raises(JobError, match="being written by another dsjax job"):
            ResultsFile(str(tmp_path / "alias.jsonl"), str(inp))


def test_whole_json_without_its_newline_is_no_torn_record(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "o.jsonl"
    inp.write_text("{}\n")
    for content in (b'{"id": "batch_req_mine", "note": "x"}', b"\0" * 4096):
        out.write_bytes(content)
        with pytest.raises(JobError, match="not an output of this job"):
            ResultsFile(str(out), str(inp))
        assert out.read_bytes() == content
    whole = b'{"id": "batch_req_1", "custom_id": "a", "response": null, "error": null}'
    out.write_bytes(whole)  # a record whose newline was never written: kept, and the newline added
    with ResultsFile(str(out), str(inp)) as f:
        assert f.is_done(line(1, "a"))
    assert out.read_bytes() == whole + b"\n"


def test_nothing_is_created_before_the_job_starts_writing(tmp_path):
    inp, out = tmp_path / "in.jsonl", str(tmp_path / "o.jsonl")
    inp.write_text("{}\n")
    f = ResultsFile(out, str(inp))
    assert not os.path.exists(out) and not os.path.exists(fingerprint_path(out))
    f.open()
    assert os.path.exists(out) and os.path.exists(fingerprint_path(out))
    f.close()
    assert fingerprint_path(out) == out + ".input.json"
