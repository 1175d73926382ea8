"""The partition run's one writer: drains the answered rows into the warehouse in chunks.

Answers are accepted without ever waiting for a write: they pile up in `pending` while a write is
in flight and go out together in the next one, no sooner than the session's `write_interval_s`
after the previous write (a BigQuery MERGE is a job of seconds; DuckDB takes one per second) and
at most `max_rows` at a time. After each confirmed write the journal's segments up to it are
deleted. A row the warehouse refuses for its values becomes that row's failure
(`unstorable_value`), never a wedged partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

from .journal import ResultJournal

DEFAULT_WRITE_INTERVAL_S = 1.0
DEFAULT_MAX_WRITE_ROWS = 20_000
UNSTORABLE_VALUE = "unstorable_value"


def storable(value: Any) -> Any:
    """Text any warehouse takes (lone UTF-16 surrogates -> U+FFFD); NaN and infinity -> NULL."""
    if isinstance(value, str):
        if value.isascii():
            return value
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            # Through UTF-16 so a valid surrogate pair becomes its character, a lone one U+FFFD.
            return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def storable_row(row: dict[str, Any]) -> dict[str, Any]:
    """The row with every text and float value made storable (in place; the id is kept)."""
    for k, v in row.items():
        if isinstance(v, str):
            if not v.isascii() and k != "id":
                row[k] = storable(v)
        elif isinstance(v, float) and k != "id":
            row[k] = storable(v)
    return row


def unstorable(row: dict[str, Any], exc: BaseException) -> dict[str, Any]:
    """The row as a failure the warehouse can store: the offending answer dropped, the reason
    kept (ASCII only, so the reason itself cannot be refused)."""
    reason = f"{type(exc).__name__}: {str(exc)[:300]}"
    reason = reason.encode("ascii", "backslashreplace").decode("ascii")
    out = {
        k: (v if isinstance(v, int | float) and storable(v) is not None else None)
        for k, v in row.items()
    }
    out.update(
        id=row["id"],
        partition_key=row.get("partition_key"),
        status="failed",
        error_class=UNSTORABLE_VALUE,
        error=f"the warehouse refused this row's values ({reason}); the answer was dropped",
        model=row.get("model"),
        completed_at=row.get("completed_at"),
    )
    return out


def write_storable(
    write: Callable[[list[dict[str, Any]]], None], rows: list[dict[str, Any]]
) -> None:
    """Write rows; when the warehouse refuses the chunk, find the rows it refuses (halving) and
    write them as `unstorable_value` failures. If even a stripped row is refused, the warehouse
    itself is failing: raise its error."""
    try:
        write(rows)
        return
    except Exception as exc:
        first_error = exc
    try:
        write([unstorable(rows[0], first_error)])  # does the warehouse take anything at all?
    except Exception:
        raise first_error from None
    _bisect(write, rows)


def _bisect(write: Callable[[list[dict[str, Any]]], None], rows: list[dict[str, Any]]) -> None:
    try:
        write(rows)
    except Exception as exc:
        if len(rows) == 1:
            write([unstorable(rows[0], exc)])
            return
        mid = len(rows) // 2
        _bisect(write, rows[:mid])
        _bisect(write, rows[mid:])


class ChunkWriter:
    """One task writing `pending` rows in chunks; `add` never waits."""

    def __init__(
        self,
        write: Callable[[list[dict[str, Any]]], None],
        journal: ResultJournal,
        *,
        interval_s: float = DEFAULT_WRITE_INTERVAL_S,
        max_rows: int = DEFAULT_MAX_WRITE_ROWS,
        before_write: Callable[[], None] | None = None,
        last_answer_eta: Callable[[], float | None] | None = None,
    ) -> None:
        """`last_answer_eta`: seconds until the last answer is expected (None: unknown). When
        it is within one write's duration, a write started now would make the final write
        queue behind it; the writer waits for those answers instead (bounded), so the final
        write follows the last answer at once: one write's latency saved per partition."""
        self._write = write
        self._journal = journal
        self.interval_s = max(0.0, float(interval_s))
        self.max_rows = max(1, max_rows)
        self._before_write = before_write
        self._eta = last_answer_eta
        self._last_duration = 0.0
        self.pending: list[dict[str, Any]] = []
        self.added = 0  # rows taken so far; they are written in this order
        self.written = 0
        self.writes = 0
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._closing = False
        self._closed = asyncio.Event()
        self._last = float("-inf")

    def add(self, row: dict[str, Any]) -> None:
        self.extend([row])

    def extend(self, rows: list[dict[str, Any]]) -> None:
        was = len(self.pending)
        self.pending.extend(rows)
        self.added += len(rows)
        n = len(self.pending)
        if was == 0 or n >= self.max_rows:
            self._wake.set()
        if n >= 2 * self.max_rows:
            self._room.clear()

    async def room(self) -> None:
        """Wait while 2 chunks' worth of rows are pending: memory stays bounded when the
        warehouse is slower than the answers (the journal has them all anyway)."""
        await self._room.wait()

    async def close(self) -> None:
        """Write everything still pending, then stop."""
        self._closing = True
        self._closed.set()
        self._wake.set()

    async def run(self) -> None:
        self._last = time.monotonic()  # the first write, too, carries an interval's answers
        while True:
            while not self.pending:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
            delay = self._last + self.interval_s - time.monotonic()
            while delay > 0 and len(self.pending) < self.max_rows and not self._closing:
                self._wake.clear()
                try:  # asyncio.timeout: wait_for can lose a cancel on 3.11 (engine/cancel.py)
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
                except TimeoutError:
                    break
                delay = self._last + self.interval_s - time.monotonic()
            take = self.max_rows
            eta = self._eta() if self._eta is not None and not self._closing else None
            if eta is not None and eta <= self._last_duration:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.5 * eta + 0.05):
                        await self._closed.wait()
                take = 2 * self.max_rows  # the last answers in one write (`room` bounds them)
            rows = self.pending[:take]
            del self.pending[:take]
            if len(self.pending) < 2 * self.max_rows:
                self._room.set()
            # Every row appended so far is in `rows` unless a chunk's worth is still pending.
            mark = None if self.pending else self._journal.rotate()
            if self._before_write is not None:
                self._before_write()
            self._last = time.monotonic()
            await asyncio.to_thread(write_storable, self._write, rows)
            self._last_duration = time.monotonic() - self._last
            self.written += len(rows)
            self.writes += 1
            if mark is not None:
                self._journal.commit(mark)


async def write_what_arrived(writer: ChunkWriter, writing: asyncio.Task[None]) -> None:
    """A run that is failing: write what arrived if the warehouse takes it within 30 s (else
    it stays in the journal for the next run)."""
    await writer.close()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(30):
            await asyncio.shield(writing)
