"""Reading a batch input file (OpenAI Batch format): one request per line, bad lines become errors.

A line is `{"custom_id": str, "method": "POST", "url": <endpoint>, "body": {...}}`. Every problem with a
line is reported on that line alone (an `InputLine` carrying an `ErrorInfo`); the job goes on.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator

ENDPOINTS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")


class JobError(RuntimeError):
    """The job cannot run at all (unreadable input, unwritable output): raised before any work."""


@dataclasses.dataclass(frozen=True)
class ErrorInfo:
    code: str
    message: str


@dataclasses.dataclass(frozen=True)
class InputLine:
    line_no: int  # 1-based
    custom_id: str | None
    url: str | None
    body: dict[str, Any] | None
    error: ErrorInfo | None = None
    occurrence: int = 1  # the n-th line with this custom_id (duplicates are errors)


def _bad(line_no, custom_id, code, message) -> InputLine:
    where = f"line {line_no}: " if custom_id is None else ""
    return InputLine(line_no, custom_id, None, None, ErrorInfo(code, where + message))


def check_readable(path: str) -> None:
    if not os.path.isfile(path):
        raise JobError(f"input {path!r} does not exist or is not a file")
    if not os.access(path, os.R_OK):
        raise JobError(f"input {path!r} is not readable")


def read_lines(path: str) -> Iterator[InputLine]:
    """Every non-blank line of the input, parsed and validated, in file order."""
    check_readable(path)
    seen: dict[str, int] = {}
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            yield _parse(line_no, raw, seen)


def _parse(line_no: int, raw: bytes, seen: dict[str, int]) -> InputLine:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _bad(line_no, None, "invalid_json", f"not valid JSON ({e})")
    if not isinstance(obj, dict):
        return _bad(line_no, None, "invalid_request", "a request line must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return _bad(line_no, None, "missing_custom_id", "'custom_id' must be a non-empty string")
    occurrence = seen.get(cid, 0) + 1
    seen[cid] = occurrence
    if occurrence > 1:
        return dataclasses.replace(_bad(line_no, cid, "duplicate_custom_id",
                                        f"custom_id {cid!r} already used by an earlier line (line {line_no})"),
                                   occurrence=occurrence)
    method = obj.get("method", "POST")
    if method != "POST":
        return _bad(line_no, cid, "invalid_method", f"method must be 'POST', got {method!r}")
    url = obj.get("url")
    if url not in ENDPOINTS:
        return _bad(line_no, cid, "unsupported_url", f"url must be one of {list(ENDPOINTS)}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return _bad(line_no, cid, "invalid_body", "'body' must be a JSON object")
    return InputLine(line_no, cid, url, body)
