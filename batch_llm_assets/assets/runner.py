"""One partition run: read the slice in chunks, skip what is done, send the rest, write as it goes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg

from ..engine import errors as E
from ..engine.engine import ChatRequest, ChatResult
from ..engine.structured import provider_kind, shape_request, validator
from ..resources.llm import LLMResource
from ..warehouses.base import OutputTable, SliceFilter, SourceRef, WarehouseSession
from .journal import ResultJournal, default_journal_dir
from .pricing import cost_usd, price_for
from .prompt import CompiledPrompt
from .structured import OutputSchema

PROGRESS_EVERY_S = 30.0
FLUSH_EVERY_S = 1.0


def request_hash(messages: list[dict[str, Any]], model: str, params: dict[str, Any]) -> str:
    """Identity of a request for resume: the same prompt, model and params is the same work."""
    doc = json.dumps({"m": messages, "model": model, "p": params}, sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()


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
        # An answer that failed validation was still paid for (typed outputs: invalid_output).
        if (r.ok or r.completion_tokens) and self.cost_usd is not None:
            self.cost_usd = None if cost is None else self.cost_usd + cost
        self.retries += max(0, r.attempts - 1)
        self.http_429 += r.http_429
        self.rate_limit_wait_s += r.rate_limit_wait_s
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
    output_schema: OutputSchema | None = None  # typed outputs (assets/structured.py)
    repair_attempts: int = 1


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
        self.params = {**llm.params, **spec.params}
        self.price = price_for(
            self.model,
            input_override=llm.price_input_per_1m,
            output_override=llm.price_output_per_1m,
        )
        self.stats = RunStats(cost_usd=0.0 if self.price is not None else None)
        self.journal = ResultJournal(
            journal_dir or default_journal_dir(),
            f"{warehouse_identity}|{spec.output.name}",
            partition_key,
        )
        self._hashes: dict[Any, str] = {}
        self.typed = spec.output_schema
        # -- typed outputs: the provider's form of structured output (lead: switch to profiles) --
        self.provider_kind = provider_kind(
            llm.base_url, api_version=llm.api_version, provider=getattr(llm, "provider", None)
        )

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
    def _requests(self) -> Iterator[ChatRequest]:
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
                params, messages = self._shape(messages)
                # The structured params (the schema) are part of the identity: a changed schema
                # re-runs the rows.
                h = request_hash(messages, self.model, {**self.params, **(params or {})})
                if done.get(rid) == h:
                    self.stats.skipped += 1
                    continue
                self._hashes[rid] = h
                if self.typed is None:
                    yield ChatRequest(rid, messages)
                    continue
                yield ChatRequest(
                    rid,
                    messages,
                    params=params,
                    validate=validator(self.typed.parse),
                    repair_attempts=self.spec.repair_attempts,
                )

    def _shape(
        self, messages: list[dict[str, Any]]
    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """Typed outputs: the request's structured params and messages (unchanged without)."""
        if self.typed is None:
            return None, messages
        return shape_request(
            self.provider_kind,
            self.typed.json_schema(),
            messages,
            {},
            name=self.typed.name,
            strict=self.typed.strict_ok,
        )

    def _row(self, r: ChatResult, now: datetime) -> dict[str, Any]:
        cost = cost_usd(self.price, r.prompt_tokens, r.completion_tokens)
        self.stats.add(r, cost)
        return {
            "id": r.id,
            "partition_key": self.partition_key,
            "response": r.response,
            "status": r.status,
            "error_class": r.error_class,
            "error": r.error_message,
            "model": self.model,
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens,
            "cost_usd": cost,
            "latency_ms": r.latency_ms,
            "attempts": r.attempts,
            "request_hash": self._hashes.pop(r.id, None),
            "completed_at": now,
            **self._typed_values(r),
        }

    def _typed_values(self, r: ChatResult) -> dict[str, Any]:
        """Typed outputs: each field of a valid answer in its own column (NULL otherwise)."""
        if self.typed is None:
            return {}
        if not r.ok:
            return dict.fromkeys(self.typed.names)
        return self.typed.row_values(r.response)

    async def _run(self) -> None:
        started = time.monotonic()
        last_log = flushed = started
        next_pct = 10
        buffer: list[dict[str, Any]] = []
        writing: asyncio.Task[None] | None = None
        async with self.llm.engine(model=self.spec.model, params=self.spec.params) as engine:
            results: AsyncIterator[ChatResult] = engine.map(_threaded(self._requests()))
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


def check_failures(stats: RunStats, max_failed_fraction: float, metadata: dict[str, Any]) -> None:
    """Fail the materialisation (after every row was written) when too many rows failed."""
    attempted = stats.ok + stats.failed
    if stats.aborted or (attempted and stats.failed / attempted > max_failed_fraction):
        top = ", ".join(f"{k} ({n})" for k, n in stats.errors.most_common(3))
        why = stats.aborted or (
            f"{stats.failed} of {attempted} rows failed "
            f"({stats.failed / attempted:.1%} > {max_failed_fraction:.1%})"
        )
        raise dg.Failure(
            description=f"{why}. Top errors: {top}. Every row was written; rerun the partition "
            "to retry only the failed rows.",
            metadata=metadata,
        )
