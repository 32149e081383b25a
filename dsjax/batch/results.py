"""The batch output file: one JSON record per input line, appended and flushed as each finishes.

Re-opening an existing output resumes it: a torn last line (a crash mid-write) is cut off, and the
records already there say which input lines are done, so a re-run writes exactly the missing ones.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from dsjax.batch.jobfile import ErrorInfo, InputLine, JobError

_FSYNC_EVERY_S = 1.0


def line_key(line: InputLine) -> tuple:
    """What identifies an input line's record across runs: its custom_id, or its line number where it
    has none or repeats an earlier line's."""
    if line.custom_id is None or line.occurrence > 1:
        return ("line", line.line_no)
    return ("id", line.custom_id)


def record_key(record: dict) -> tuple:
    err = record.get("error") or {}
    if record.get("custom_id") is None or err.get("code") == "duplicate_custom_id":
        return ("line", record.get("line"))
    return ("id", record["custom_id"])


def success_record(line: InputLine, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": 200, "request_id": f"req_{uuid.uuid4().hex}", "body": body},
            "error": None}


def error_record(line: InputLine, error: ErrorInfo) -> dict[str, Any]:
    rec = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id, "response": None,
           "error": {"code": error.code, "message": error.message}}
    rec["line"] = line.line_no  # the handle on lines without a (unique) custom_id
    return rec


class ResultsFile:
    """Append-only JSONL output that knows which input lines it already holds."""

    def __init__(self, path: str):
        self.path = path
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise JobError(f"output folder {parent!r} does not exist")
        self.done: set[tuple] = set()
        self.repaired_bytes = 0
        if os.path.exists(path):
            self._load_existing()
        try:
            self._f = open(path, "ab")
        except OSError as e:
            raise JobError(f"cannot write output {path!r}: {e}") from None
        self._last_sync = time.monotonic()

    def _load_existing(self) -> None:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise JobError(f"cannot read existing output {self.path!r}: {e}") from None
        good_end = 0
        for raw in data.splitlines(keepends=True):
            if not raw.endswith(b"\n"):
                break  # torn last line
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                if good_end + len(raw) == len(data):
                    break  # a torn line that happened to end in a newline byte
                raise JobError(f"{self.path!r} holds a line that is not JSON before its end: it is not an "
                               "output of this job; choose another output path") from None
            self.done.add(record_key(rec))
            good_end += len(raw)
        if good_end < len(data):
            self.repaired_bytes = len(data) - good_end
            with open(self.path, "r+b") as f:
                f.truncate(good_end)

    def is_done(self, line: InputLine) -> bool:
        return line_key(line) in self.done

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        self._f.flush()
        now = time.monotonic()
        if now - self._last_sync >= _FSYNC_EVERY_S:
            os.fsync(self._f.fileno())
            self._last_sync = now

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
