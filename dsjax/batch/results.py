"""The batch output file: one JSON record per input line, appended and flushed as each finishes.

Re-opening an existing output resumes it: the records already there say which input lines are done, so
a re-run writes exactly the missing ones, and a torn last line (a crash mid-write) is cut off. Only a
file that is recognisably a dsjax batch output is ever changed: anything else is refused before any
work, naming the file. Beside the output live two small files: `<output>.lock`, held while a job writes
it (a second job on the same output is refused at once), and `<output>.input.json`, the fingerprint of
the input the output was made from (a resume from a changed input is refused unless asked for).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import socket
import stat
import time
import uuid
from typing import Any

from dsjax.batch.jobfile import ErrorInfo, InputLine, JobError

_FSYNC_EVERY_S = 1.0
# How every record line starts (`json.dumps` keeps the dict's order): a torn tail is repaired only if
# it is the beginning of a record.
_RECORD_START = b'{"id": "batch_req_'


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


# What differs between two runs of the same job by design: ids, timestamps, signatures.
VOLATILE = frozenset({"id", "created", "created_at", "completed_at", "request_id", "signature", "system_fingerprint",
                      "encrypted_content"})


def comparable(record: Any) -> Any:
    """A record's content without its ids and timestamps (`VOLATILE`): equal for two runs of a job that give the
    same outputs (with `--batch-invariant`, any two runs of the same input; docs/generate.md)."""
    if isinstance(record, dict):
        return {k: comparable(v) for k, v in record.items() if k not in VOLATILE}
    if isinstance(record, list):
        return [comparable(v) for v in record]
    return record


def encode_record(record: dict[str, Any]) -> bytes:
    """One output line. Text that is not valid Unicode (a lone surrogate from a `\\ud800` escape in the
    input) is written as JSON escapes, so the line stays valid UTF-8 and reads back as it was."""
    try:
        return json.dumps(record, ensure_ascii=False).encode() + b"\n"
    except UnicodeEncodeError:
        return json.dumps(record).encode() + b"\n"


def is_record(obj: Any) -> bool:
    """Whether `obj` has the shape of a record this job writes."""
    return (isinstance(obj, dict) and isinstance(obj.get("id"), str) and obj["id"].startswith("batch_req_")
            and {"custom_id", "response", "error"} <= obj.keys()
            and (obj["custom_id"] is None or isinstance(obj["custom_id"], str)))


def lock_path(output: str) -> str:
    """Beside the real file: two paths to one output (a symbolic link) take the same lock."""
    return os.path.realpath(output) + ".lock"


def fingerprint_path(output: str) -> str:
    return output + ".input.json"


@dataclasses.dataclass(frozen=True)
class InputFingerprint:
    """What an output was made from: the input's size and sha256 (its path only for messages)."""

    path: str
    bytes: int
    sha256: str

    @classmethod
    def of(cls, path: str) -> "InputFingerprint":
        h, n = hashlib.sha256(), 0
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
                n += len(block)
        return cls(os.path.abspath(path), n, h.hexdigest())


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_output(path: str, input_path: str | None = None) -> None:
    """Raise JobError if `path` cannot be a job's output: its folder is missing, it (or its lock or
    fingerprint) is the input, or it exists and is no regular file (a pipe, a device, a folder)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.abspath(path).startswith(("/dev/", "/proc/")):
        raise JobError(f"output {path!r} is a device or a process's file: the job keeps its lock, input "
                       "fingerprint and summary beside the output, so give a path in a folder of files")
    if not os.path.isdir(parent):
        raise JobError(f"output folder {parent!r} does not exist")
    if input_path is not None:
        for what, p in (("output", path), ("output's lock", lock_path(path)),
                        ("output's input fingerprint", fingerprint_path(path))):
            if (os.path.exists(p) and _same_file(p, input_path)) or os.path.realpath(p) == os.path.realpath(input_path):
                raise JobError(f"the {what} {p!r} is the input file: the job would write into the file it "
                               "reads; choose another --output")
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        raise JobError(f"output {path!r} is not a regular file (a pipe, device or folder): the job reads an "
                       "existing output to resume it, so it writes only to files")


class ResultsFile:
    """Append-only JSONL output that knows which input lines it already holds.

    Raises JobError, before changing anything, when `path` is the input, is not a regular file, is held
    by another job, is not a dsjax batch output, or was made from another input than `input_path`
    (unless `allow_changed_input`). Holds the output's lock until `close`."""

    def __init__(self, path: str, input_path: str | None = None, allow_changed_input: bool = False):
        self.path = path
        self.done: set[tuple] = set()
        self.repaired_bytes = 0
        self.input_changed = False
        self._lock_fd: int | None = None
        self._f = None
        check_output(path, input_path)
        try:
            self._lock()
            records = self._load_existing() if os.path.exists(path) else 0
            self._fingerprint = None
            if input_path is not None:
                self._fingerprint = self._check_fingerprint(InputFingerprint.of(input_path), records,
                                                            allow_changed_input)
            if os.path.exists(path) and not os.access(path, os.W_OK):
                raise JobError(f"cannot write output {path!r}: permission denied")
        except BaseException:
            self._unlock()
            raise
        self._last_sync = time.monotonic()

    def open(self) -> None:
        """Create the output (and its fingerprint) if need be: the job calls it once its model is loaded,
        so a job that fails before any work leaves no files behind but those that were there."""
        if self._f is not None:
            return
        if self._fingerprint is not None:
            self._write_fingerprint(self._fingerprint)
        try:
            self._f = open(self.path, "ab")
        except OSError as e:
            raise JobError(f"cannot write output {self.path!r}: {e.strerror or e}") from None

    # ---------------------------------------------------------------- the lock
    def _lock(self) -> None:
        """Take `<output>.lock` (flock, released by the kernel if this process dies); the file names its
        holder. A lock file that another process removed while this one waited is taken again."""
        lp = lock_path(self.path)
        for _ in range(10):
            try:
                fd = os.open(lp, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                raise JobError(f"cannot create the output's lock file {lp!r}: {e.strerror or e}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise JobError(f"cannot lock {lp!r}: {e.strerror or e}") from None
                raise JobError(f"output {self.path!r} is being written by another dsjax job ({holder or 'unknown'}; "
                               f"lock {lp!r}): wait for it to finish or choose another --output") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(lp).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder finished and removed the file between our open and flock
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
            self._lock_fd = fd
            return
        raise JobError(f"could not take the lock {lp!r}: other jobs keep replacing it")

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            try:
                os.unlink(lock_path(self.path))
            except OSError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None

    # ---------------------------------------------------------------- resuming
    def _not_ours(self, why: str) -> JobError:
        return JobError(f"{self.path!r} is not an output of this job ({why}); nothing was changed: choose "
                        "another --output, or move that file away")

    def _load_existing(self) -> int:
        """Read the records already written; cut a torn last line. Returns how many records there are."""
        good_end = records = 0
        torn = None
        self._missing_newline = False
        try:
            with open(self.path, "rb") as f:
                for line_no, raw in enumerate(f, start=1):
                    if torn is not None:  # a bad line that was not the last
                        raise self._not_ours(f"line {torn} is not a record")
                    try:
                        rec = json.loads(raw)
                        parsed = True
                    except (ValueError, RecursionError):
                        rec, parsed = None, False
                    if not is_record(rec):
                        # A whole JSON value is no torn write; zeros are, after this job's records only.
                        if parsed or not _torn(raw) or (not raw.strip(b"\0\n") and not records):
                            raise self._not_ours(f"line {line_no} is not a record of a dsjax batch output")
                        torn = line_no
                        continue
                    if not raw.endswith(b"\n"):  # a whole record whose newline was not written
                        self.done.add(record_key(rec))
                        self._missing_newline = True
                        records += 1
                        break
                    self.done.add(record_key(rec))
                    good_end += len(raw)
                    records += 1
                end = f.tell()
        except OSError as e:
            raise JobError(f"cannot read the existing output {self.path!r}: {e.strerror or e}") from None
        if good_end < end and not self._missing_newline:
            self.repaired_bytes = end - good_end
            with open(self.path, "r+b") as f:
                f.truncate(good_end)
        elif self._missing_newline:
            with open(self.path, "ab") as f:
                f.write(b"\n")
            self.repaired_bytes = 1
        return records

    def _check_fingerprint(self, now: InputFingerprint, records: int, allow_changed: bool) -> InputFingerprint | None:
        """Refuse a changed input (unless `allow_changed`); the fingerprint to write, if it must be."""
        fp = fingerprint_path(self.path)
        before = None
        if records and os.path.exists(fp):
            try:
                with open(fp) as f:
                    before = json.load(f)
            except (OSError, ValueError) as e:
                raise JobError(f"cannot read the output's input fingerprint {fp!r}: {e}; remove it to resume "
                               "without checking the input") from None
        if isinstance(before, dict) and before.get("sha256") != now.sha256:
            if not allow_changed:
                raise JobError(
                    f"the input {now.path!r} changed since {self.path!r} was started from it (sha256 "
                    f"{str(before.get('sha256'))[:12]}…, {before.get('bytes')} bytes then; {now.sha256[:12]}…, "
                    f"{now.bytes} bytes now; {records} records written): resuming would mix results of two "
                    "inputs. Choose another --output, or pass --allow-changed-input to go on (lines whose "
                    "custom_id already has a record are skipped)")
            self.input_changed = True
        return now if before is None or self.input_changed else None

    def _write_fingerprint(self, now: InputFingerprint) -> None:
        fp = fingerprint_path(self.path)
        tmp = fp + f".tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(dataclasses.asdict(now), f, indent=1)
            os.replace(tmp, fp)
        except OSError as e:
            raise JobError(f"cannot write the output's input fingerprint {fp!r}: {e.strerror or e}") from None

    # ---------------------------------------------------------------- writing
    def is_done(self, line: InputLine) -> bool:
        return line_key(line) in self.done

    def write(self, record: dict[str, Any]) -> None:
        self.open()
        self._f.write(encode_record(record))
        self._f.flush()
        now = time.monotonic()
        if now - self._last_sync >= _FSYNC_EVERY_S:
            os.fsync(self._f.fileno())
            self._last_sync = now

    def close(self) -> None:
        if self._f is not None and not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        self._unlock()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _torn(raw: bytes) -> bool:
    """Whether a last line that is no record is what a crash mid-write leaves: the start of a record (the
    write cut short), or zeros (blocks a filesystem allocated but never wrote)."""
    body = raw.rstrip(b"\n")
    return (body.startswith(_RECORD_START) or _RECORD_START.startswith(body)) or not body.strip(b"\0")
