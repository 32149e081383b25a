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
    if not os.path.exists(path):
        raise JobError(f"input {path!r} does not exist")
    if not os.path.isfile(path):
        raise JobError(f"input {path!r} is not a regular file (a folder, pipe or device): the job reads its "
                       "input more than once (to count, fingerprint and resume it), so it takes files only")
    if not os.access(path, os.R_OK):
        raise JobError(f"input {path!r} is not readable")


def read_lines(path: str) -> Iterator[InputLine]:
    """Every non-blank line of the input, parsed and validated, in file order."""
    check_readable(path)
    seen: dict[str, tuple[int, int]] = {}  # custom_id -> (its first line, lines so far)
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            yield _parse(line_no, raw, seen)


def clip(text: str, limit: int = 300) -> str:
    """`text` cut to `limit` characters for a message (a 1 MB custom_id must not make a 1 MB error)."""
    return text if len(text) <= limit else text[:limit] + f"… ({len(text):,} characters)"


def _parse(line_no: int, raw: bytes, seen: dict[str, tuple[int, int]]) -> InputLine:
    try:
        obj = json.loads(raw)
    except RecursionError:
        return _bad(line_no, None, "invalid_json", "JSON nested too deeply to read")
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4,300 digits
        return _bad(line_no, None, "invalid_json", f"not valid JSON ({clip(str(e))})")
    if not isinstance(obj, dict):
        return _bad(line_no, None, "invalid_request", "a request line must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return _bad(line_no, None, "missing_custom_id", "'custom_id' must be a non-empty string")
    first, count = seen.get(cid, (line_no, 0))
    seen[cid] = (first, count + 1)
    if count:
        return dataclasses.replace(_bad(line_no, cid, "duplicate_custom_id",
                                        f"custom_id {clip(cid)!r} is already used by line {first}"),
                                   occurrence=count + 1)
    method = obj.get("method", "POST")
    if method != "POST":
        return _bad(line_no, cid, "invalid_method", f"method must be 'POST', got {clip(repr(method))}")
    url = obj.get("url")
    if url not in ENDPOINTS:
        return _bad(line_no, cid, "unsupported_url", f"url must be one of {list(ENDPOINTS)}, got {clip(repr(url))}")
    body = obj.get("body")
    if not isinstance(body, dict):
        return _bad(line_no, cid, "invalid_body", "'body' must be a JSON object")
    return InputLine(line_no, cid, url, body)
