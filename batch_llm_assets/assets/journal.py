"""A local journal of results not yet in the warehouse, so a killed run's answers are not lost.

Every result is appended the moment it arrives (one line; the lines of one event-loop turn are
written to the OS together at its end: they survive SIGKILL, not a power cut); the next run of the same partition writes what it finds into the warehouse
before sending anything. The journal is a series of segment files: the writer starts a new
segment each time it takes the pending rows, and deletes the segments the warehouse has confirmed,
so the journal on disk stays about a chunk long, and recovery reads it a chunk at a time.
Only the holder of the partition's lease (see lease.py) opens it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ..engine.errors import BatchLLMError

JOURNAL_DIR_ENV = "BATCH_LLM_JOURNAL_DIR"


class JournalError(BatchLLMError):
    """The journal cannot be written (disk full, read-only, no permission): the run stops."""


def default_journal_dir() -> Path:
    return Path(
        os.environ.get(JOURNAL_DIR_ENV) or Path(tempfile.gettempdir()) / "batch-llm-journal"
    )


def journal_key(scope: str, partition_key: str) -> str:
    """The file name stem of one scope (warehouse + output table) and partition."""
    return hashlib.sha256(f"{scope}|{partition_key}".encode()).hexdigest()[:24]


class ResultJournal:
    def __init__(self, directory: Path, scope: str, partition_key: str) -> None:
        """`scope` names the warehouse and output table; one journal per scope and partition."""
        self.directory = directory
        self.key = journal_key(scope, partition_key)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _error("create the journal directory", directory, exc) from None
        self.path = directory / f"{self.key}.jsonl"  # the layout before segments: still recovered
        self._fd: int | None = None
        self._buffer: list[dict[str, Any]] = []
        self._segment = self._last_segment()
        self._committed = self._segment  # segments up to this one are in the warehouse

    # -- segments --------------------------------------------------------------------------
    def _segment_path(self, n: int) -> Path:
        return self.directory / f"{self.key}.{n:08d}.jsonl"

    def _segments(self) -> list[Path]:
        found = sorted(self.directory.glob(f"{self.key}.*.jsonl"))
        return ([self.path] if self.path.exists() else []) + found

    def _last_segment(self) -> int:
        numbers = [int(p.name.split(".")[1]) for p in self._segments() if p != self.path]
        return max(numbers, default=0)

    # -- recovery --------------------------------------------------------------------------
    def recover_chunks(self, chunk_rows: int) -> Iterator[list[dict[str, Any]]]:
        """Rows left by an earlier run, oldest first, `chunk_rows` at a time (a torn last line
        is skipped). Later lines win over earlier ones for the same id, as upserts do."""
        chunk: dict[Any, dict[str, Any]] = {}
        for path in self._segments():
            try:
                with path.open(encoding="utf-8", errors="replace") as f:
                    for line in f:
                        row = _decode(line)
                        if row is None:
                            continue  # the line being written when the process died
                        chunk.pop(_id_key(row["id"]), None)
                        chunk[_id_key(row["id"])] = row
                        if len(chunk) >= chunk_rows:
                            yield list(chunk.values())
                            chunk = {}
            except OSError as exc:
                raise _error("read", path, exc) from None
        if chunk:
            yield list(chunk.values())

    # -- appending -------------------------------------------------------------------------
    def append(self, row: dict[str, Any]) -> None:
        """Hold the row for `flush`, which the caller runs at the end of the event-loop turn:
        one encoding pass and one write for all the answers of a turn, not one per answer.
        The row must not change after this."""
        self._buffer.append(row)

    def extend(self, rows: list[dict[str, Any]]) -> None:
        """`append` for each row."""
        self._buffer.extend(rows)

    def flush(self) -> None:
        """Hand the held lines to the OS (they survive SIGKILL from then on)."""
        if not self._buffer:
            return
        # Line by line into one buffer: each bytes orjson returns holds a 64 KiB allocation
        # (measured with tracemalloc, orjson 3.13), so a list of them costs 64 KiB a row.
        data = bytearray()
        for row in self._buffer:
            data += _encode(row)
            data += b"\n"
        self._buffer.clear()
        path = self._segment_path(self._segment)
        try:
            if self._fd is None:
                self._segment += 1
                path = self._segment_path(self._segment)
                self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self._abandon()
            raise _error("append to", path, exc) from None

    def rotate(self) -> int:
        """End the current segment: rows appended from now on go to a new one. Returns the mark
        to pass to `commit` once every row appended so far is in the warehouse."""
        self.flush()
        self.close()
        return self._segment

    def commit(self, mark: int) -> None:
        """Every row of segments up to `mark` is in the warehouse: delete them."""
        for n in range(self._committed + 1, mark + 1):
            _unlink(self._segment_path(n))
        self._committed = max(self._committed, mark)

    def clear(self) -> None:
        """Delete every segment (after recovery, or when the run wrote everything)."""
        self._buffer.clear()
        self.close()
        for path in self._segments():
            _unlink(path)
        self._committed = self._segment

    def close(self) -> None:
        """Flush what is held (an error here was or will be reported by the run), then close."""
        try:
            self.flush()
        except JournalError:
            pass
        self._abandon()

    def _abandon(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _unlink(path: Path) -> None:
    """Delete a segment whose rows are in the warehouse. One that cannot be deleted (the file
    system went read-only) stays: the next run writes the same rows again, which changes
    nothing, and deletes it then."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _error(action: str, path: Path, exc: OSError) -> JournalError:
    return JournalError(
        description=f"Could not {action} the result journal {path}: {exc.strerror or exc} "
        f"(errno {exc.errno}). Sending stopped; answers already received were kept. Free the "
        f"disk or fix the permissions of {path.parent} (or set {JOURNAL_DIR_ENV}) and rerun."
    )


# -- typed values ----------------------------------------------------------------------------
# Ids keep their type across a round trip: JSON has only str, int, float; the rest is tagged.


def _tag(value: Any) -> Any:
    if isinstance(value, datetime):
        return {"$dt": value.isoformat()}
    if isinstance(value, date):
        return {"$d": value.isoformat()}
    if isinstance(value, Decimal):
        return {"$dec": str(value)}
    if isinstance(value, uuid.UUID):
        return {"$uuid": str(value)}
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$b64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, np.ndarray) and value.dtype == np.float32 and value.ndim == 1:
        # An embedding: its float32 bytes, exact and a third of the size of its floats as text.
        return {"$f32": base64.b64encode(value.astype("<f4", copy=False).tobytes()).decode()}
    raise TypeError(f"cannot journal a {type(value).__name__}")


_UNTAG = {
    "$dt": datetime.fromisoformat,
    "$d": date.fromisoformat,
    "$dec": Decimal,
    "$uuid": uuid.UUID,
    "$b64": base64.b64decode,
    "$f32": lambda text: np.frombuffer(base64.b64decode(text), dtype="<f4"),
}


def _untag(obj: dict[str, Any]) -> Any:
    if len(obj) == 1:
        ((k, v),) = obj.items()
        if k in _UNTAG:
            return _UNTAG[k](v)
    return obj


def _encode(row: dict[str, Any]) -> bytes:
    """One journal line (no newline). orjson on the hot path: every answer is encoded on the
    event loop. Ids that JSON or orjson would not give back as they were (UUID, Decimal, bytes,
    dates) are tagged. `completed_at`, the one datetime of a result row, is written by orjson
    as ISO-8601 text and parsed back by `_decode` (no per-row callback). Anything orjson
    refuses (an int over 64 bits) goes through the standard encoder."""
    rid = row["id"]
    if not isinstance(rid, int | str | float):
        row = {**row, "id": _tag(rid)}
    try:
        return orjson.dumps(row, default=_tag)
    except orjson.JSONEncodeError:
        return json.dumps(row, default=_tag).encode()


def _decode(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line, object_hook=_untag)
    except (ValueError, TypeError):
        return None
    if not isinstance(row, dict) or "id" not in row:
        return None
    done = row.get("completed_at")
    if type(done) is str:
        try:
            row["completed_at"] = datetime.fromisoformat(done)
        except ValueError:
            row["completed_at"] = None
    return row


def _id_key(value: Any) -> Any:
    """A hashable key for an id (a JSON list or dict id, should one come back, as text)."""
    try:
        hash(value)
        return (type(value).__name__, value)
    except TypeError:
        return ("json", json.dumps(value, default=str, sort_keys=True))
