"""One partition run: read the slice in chunks, skip what is done, send the rest, write as it goes."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..engine import errors as E
from ..engine.engine import ChatRequest, ChatResult, Engine
from ..engine.errors import redact
from ..engine.identity import request_identity
from ..resources.llm import LLMResource
from ..warehouses.base import OutputTable, SliceFilter, SourceRef, WarehouseSession
from .journal import ResultJournal, default_journal_dir
from .pricing import cost_usd, price_for, served_model
from .prompt import CompiledPrompt

PROGRESS_EVERY_S = 30.0
FLUSH_EVERY_S = 1.0


@dataclass
class RunStats:
    rows_in: int = 0
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = 0.0
    retries: int = 0
    http_429: int = 0
    rate_limit_wait_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0
    aborted: str | None = None

    @property
    def processed(self) -> int:
        return self.ok + self.failed + self.skipped

    def add(self, r: ChatResult, cost: float | None) -> None:
        if r.ok:
            self.ok += 1
        else:
            self.failed += 1
            self.errors[r.error_class or "unknown"] += 1
        self.prompt_tokens += r.prompt_tokens or 0
        self.completion_tokens += r.completion_tokens or 0
        if r.prompt_tokens is not None and self.cost_usd is not None:  # billed, even if failed
            self.cost_usd = None if cost is None else self.cost_usd + cost
        self.retries += max(0, r.attempts - 1)
        self.http_429 += r.http_429
        if r.latency_ms is not None:
            self.latencies.append(r.latency_ms)


@dataclass(frozen=True)
class RunSpec:
    source: SourceRef
    output: OutputTable
    prompt: CompiledPrompt
    model: str | None
    params: dict[str, Any]
    chunk_rows: int


class PartitionRun:
    """Runs one partition. Rows are durable per chunk; ok rows with the same hash are skipped."""

    def __init__(
        self,
        spec: RunSpec,
        llm: LLMResource,
        session: WarehouseSession,
        where: SliceFilter,
        partition_key: str,
        log: Any,
        warehouse_identity: str = "",
        journal_dir: Path | None = None,
    ) -> None:
        self.spec = spec
        self.llm = llm
        self.db = session
        self.where = where
        self.partition_key = partition_key
        self.log = log
        self.model = spec.model or llm.model
        self.price = price_for(
            self.model,
            input_override=llm.price_input_per_1m,
            output_override=llm.price_output_per_1m,
            cached_input_override=llm.price_cached_input_per_1m,
            base_url=llm.base_url,
            provider=getattr(llm, "provider", None),
            logger=log,
        )
        self.served_model: str | None = None
        self.stats = RunStats(cost_usd=0.0 if self.price is not None else None)
        self.journal = ResultJournal(
            journal_dir or default_journal_dir(),
            f"{warehouse_identity}|{spec.output.name}",
            partition_key,
        )
        self._hashes: dict[Any, str] = {}

    # -- checks before any request ---------------------------------------------------------
    def preflight(self) -> None:
        src = self.spec.source
        self.db.check_source(src)
        rows, dups, null_ids = self.db.slice_stats(src, self.where)
        if null_ids:
            raise E.BatchLLMError(
                description=f"{null_ids} row(s) of {src.table!r} in partition "
                f"{self.partition_key!r} have a NULL {src.id_column!r} (or a NaN or infinite "
                "one): an id must key exactly one row, so nothing was sent."
            )
        if dups:
            raise E.BatchLLMError(
                description=f"Duplicate ids in {src.table!r}.{src.id_column} for partition "
                f"{self.partition_key!r} (e.g. {dups}); results are keyed by id, so nothing was "
                "sent. Deduplicate the source or choose a unique id column."
            )
        self.stats.rows_in = rows
        self.db.ensure_output(self.spec.output, src)
        recovered = self.journal.recover()
        if recovered:
            for i in range(0, len(recovered), self.spec.chunk_rows):
                self.db.write_results(self.spec.output, recovered[i : i + self.spec.chunk_rows])
            self.log.info(
                f"partition {self.partition_key}: recovered {len(recovered)} results of a run "
                "that stopped before writing them"
            )
        self.journal.clear()

    # -- the run -----------------------------------------------------------------------------
    def _requests(self, engine: Engine) -> Iterator[ChatRequest]:
        for chunk in self.db.read_slice(self.spec.source, self.where, self.spec.chunk_rows):
            done = self.db.done_hashes(
                self.spec.output, self.partition_key, [r[self.spec.source.id_column] for r in chunk]
            )
            for row in chunk:
                rid = row[self.spec.source.id_column]
                messages, problem = self.spec.prompt.render(row)
                if problem is not None:
                    yield ChatRequest(rid, None, error=(problem[0], f"{problem[1]}; not sent"))
                    continue
                h = request_identity(
                    engine.request_body(messages), self.llm.base_url, self.llm.api_version
                )
                if done.get(rid) == h:
                    self.stats.skipped += 1
                    continue
                self._hashes[rid] = h
                yield ChatRequest(rid, messages)

    def _row(self, r: ChatResult, now: datetime) -> dict[str, Any]:
        cost = cost_usd(self.price, r.prompt_tokens, r.completion_tokens, cached=r.cached_tokens)
        self.stats.add(r, cost)
        self.served_model = served_model(self.model, r.model, self.served_model, self.log)
        return {
            "id": r.id,
            "partition_key": self.partition_key,
            "response": r.response,
            "status": r.status,
            "error_class": r.error_class,
            "error": redact(r.error_message, self.llm.api_key) if r.error_message else None,
            "finish_reason": r.finish_reason,
            "refusal": r.refusal,
            "model": r.model or self.model,
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens,
            "cost_usd": cost,
            "latency_ms": r.latency_ms,
            "total_ms": r.total_ms,
            "attempts": r.attempts,
            "request_hash": self._hashes.pop(r.id, None),
            "completed_at": now,
        }

    async def _run(self) -> None:
        started = time.monotonic()
        last_log = flushed = started
        next_pct = 10
        buffer: list[dict[str, Any]] = []
        writing: asyncio.Task[None] | None = None
        async with self.llm.engine(model=self.spec.model, params=self.spec.params) as engine:
            results: AsyncIterator[ChatResult] = engine.map(_threaded(self._requests(engine)))
            async for result in results:
                row = self._row(result, datetime.now(UTC))
                self.journal.append(row)
                buffer.append(row)
                now = time.monotonic()
                # The journal already holds every row; the warehouse gets them in chunks, written
                # in the background (one write at a time, in order) while answers keep coming.
                if len(buffer) >= self.spec.chunk_rows or now - flushed >= FLUSH_EVERY_S:
                    if writing is not None:
                        await writing
                    writing = asyncio.create_task(
                        asyncio.to_thread(self.db.write_results, self.spec.output, buffer)
                    )
                    buffer = []
                    flushed = now
                pct = 100 * self.stats.processed / max(1, self.stats.rows_in)
                if pct >= next_pct or now - last_log >= PROGRESS_EVERY_S:
                    self._progress(now - started)
                    last_log = now
                    next_pct = (int(pct) // 10 + 1) * 10
            self.stats.aborted = engine.aborted_reason
            self.stats.rate_limit_wait_s = engine.limiter_wait_s  # wall time, not a sum over rows
        if writing is not None:
            await writing
        if buffer:
            await asyncio.to_thread(self.db.write_results, self.spec.output, buffer)
        self.journal.clear()  # everything is in the warehouse now
        self.stats.wall_s = time.monotonic() - started

    def _progress(self, elapsed: float) -> None:
        s = self.stats
        sent = s.ok + s.failed
        rate = sent / elapsed if elapsed > 0 else 0.0
        left = s.rows_in - s.processed
        eta = f"{left / rate:.0f} s" if rate > 0 else "unknown"
        self.log.info(
            f"partition {self.partition_key}: {s.processed}/{s.rows_in} rows "
            f"({s.ok} ok, {s.failed} failed, {s.skipped} skipped), {rate:.1f} rows/s, ETA {eta}"
        )

    def run(self) -> RunStats:
        self.preflight()
        asyncio.run(self._run())
        return self.stats


async def _threaded(items: Iterator[ChatRequest]) -> AsyncIterator[ChatRequest]:
    """Pull the next request off the event loop: reading a chunk is blocking warehouse I/O."""
    sentinel = object()
    while True:
        item = await asyncio.to_thread(next, items, sentinel)
        if item is sentinel:
            return
        yield item  # type: ignore[misc]
