"""Batch input parsing: every malformed line becomes an error for that line alone."""

import json
import os

import pytest

from dsjax.batch.jobfile import JobError, read_lines


def write(tmp_path, lines):
    p = tmp_path / "in.jsonl"
    p.write_bytes(b"\n".join(x if isinstance(x, bytes) else json.dumps(x).encode() for x in lines) + b"\n")
    return str(p)


def ok(cid, url="/v1/chat/completions"):
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", "messages": []}}


def test_each_bad_line_is_reported_and_the_rest_parse(tmp_path):
    path = write(tmp_path, [
        ok("a"),
        b"{not json",
        [1, 2],
        {"method": "POST", "url": "/v1/responses", "body": {}},
        ok("a", "/v1/messages"),
        {**ok("b"), "url": "/v1/embeddings"},
        {**ok("c"), "method": "GET"},
        {**ok("d"), "body": "text"},
        b"",
        ok("e", "/v1/responses"),
    ])
    lines = list(read_lines(path))
    codes = [(x.line_no, x.error.code if x.error else None) for x in lines]
    assert codes == [(1, None), (2, "invalid_json"), (3, "invalid_request"), (4, "missing_custom_id"),
                     (5, "duplicate_custom_id"), (6, "unsupported_url"), (7, "invalid_method"),
                     (8, "invalid_body"), (10, None)]
    assert "line 2" in lines[1].error.message and lines[4].occurrence == 2
    assert lines[-1].url == "/v1/responses" and lines[-1].body["model"] == "m"


def test_unreadable_input_fails_fast(tmp_path):
    with pytest.raises(JobError, match="does not exist"):
        list(read_lines(str(tmp_path / "missing.jsonl")))


def test_lines_python_cannot_read_are_errors_of_their_line(tmp_path):
    path = write(tmp_path, [
        b'{"custom_id": "big", "body": {"seed": ' + b"7" * 5000 + b"}}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"custom_id": "bad-utf8", "body": "\xff\xfe"}',
        ok("fine"),
    ])
    lines = list(read_lines(path))
    assert [x.error.code if x.error else None for x in lines] == ["invalid_json"] * 3 + [None]
    assert "4300 digits" in lines[0].error.message and "nested too deeply" in lines[1].error.message


def test_a_duplicate_names_the_line_that_used_the_id_first(tmp_path):
    path = write(tmp_path, [ok("a"), ok("b"), ok("a"), ok("a")])
    lines = list(read_lines(path))
    assert lines[2].error.message == "custom_id 'a' is already used by line 1"
    assert lines[3].error.message == "custom_id 'a' is already used by line 1" and lines[3].occurrence == 3


def test_inputs_that_are_not_files_are_refused_by_name(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(JobError, match="is not a regular file"):
        list(read_lines(str(tmp_path / "pipe")))
    with pytest.raises(JobError, match="is not a regular file"):
        list(read_lines(str(tmp_path)))
