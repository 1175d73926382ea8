"""A local journal of results not yet in the warehouse, so a killed run's answers are not lost.

Every result is appended here the moment it arrives (one line, flushed to the OS: it survives
SIGKILL, not a power cut); the next run of the same partition writes what it finds into the
warehouse before sending anything. Without it a crash would lose, and a rerun pay again for,
every answer since the last chunk was written.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

JOURNAL_DIR_ENV = "BATCH_LLM_JOURNAL_DIR"


def default_journal_dir() -> Path:
    return Path(
        os.environ.get(JOURNAL_DIR_ENV) or Path(tempfile.gettempdir()) / "batch-llm-journal"
    )


class ResultJournal:
    def __init__(self, directory: Path, scope: str, partition_key: str) -> None:
        """`scope` names the warehouse and output table; one file per scope and partition."""
        digest = hashlib.sha256(f"{scope}|{partition_key}".encode()).hexdigest()[:24]
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{digest}.jsonl"
        self._file = None

    def recover(self) -> list[dict[str, Any]]:
        """Rows left by an earlier run, the last result per id (a torn last line is skipped)."""
        if not self.path.exists():
            return []
        rows: dict[Any, dict[str, Any]] = {}
        with self.path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # the line being written when the process died
                row["completed_at"] = datetime.fromisoformat(row["completed_at"])
                rows[row["id"]] = row
        return list(rows.values())

    def append(self, row: dict[str, Any]) -> None:
        if self._file is None:
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(row, default=_iso) + "\n")
        self._file.flush()

    def clear(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _iso(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)
