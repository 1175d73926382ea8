"""One partition run, flowing one way: reader -> render -> engine workers -> journal -> writer.

    reader           chunks of the slice, skip-done lookup, render (bounded)  -> requests
                     (reader.py: on the event loop for an embedded warehouse and a plain
                     template, else a thread that stays a bounded number of chunks ahead)
    engine workers   acquire, send, parse; the journal gets each answer at once (on_result,
                     written to the OS at the end of the loop's turn)
    consumer         counts and logs progress; never waits for a write
    writer task      drains the pending rows into the warehouse in chunks (writer.py)

The partition is leased first (lease.py): a second run of it fails before reading anything. Any
stage failing (the reader, the journal, the writer, the consumer, SIGTERM) cancels the others
within seconds; every answer already received is in the journal for the next run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..engine import cancel_and_wait
from ..engine import errors as E
from ..engine.budget import Cost
from ..engine.engine import ChatResult
from ..engine.errors import redact
from ..engine.identity import identity_scopes
from ..engine.runner import frozen_heap
from ..resources.llm import LLMResource
from ..warehouses.base import OutputTable, SliceFilter, SourceRef, WarehouseSession
from .journal import ResultJournal, default_journal_dir
from .lease import DEFAULT_LEASE_TTL_S, PartitionLease, partition_lease
from .metadata import RunStats, progress_text
from .pricing import Price, cost_usd, price_for_resource, result_cost, served_model
from .prompt import CompiledPrompt
from .reader import SliceReader
from .sharing import Sharing, reuses_answers, stored_answers
from .structured import OutputSchema
from .writer import (
    DEFAULT_MAX_WRITE_ROWS,
    DEFAULT_WRITE_INTERVAL_S,
    ChunkWriter,
    storable,
    storable_row,
    write_storable,
    write_what_arrived,
)

PROGRESS_EVERY_S = 30.0
_TEXT_FIELDS = ("response", "error", "finish_reason", "refusal", "model")


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
    identity_endpoint: bool | None = None  # None: the LLM resource's setting
    reuse_answers: bool | None = None  # None: when the request's temperature is 0

    def identity_scopes(self, llm: LLMResource) -> tuple[dict[str, Any], dict[str, Any]]:
        """The request identity's scope for this asset on `llm`, and the earlier definition's
        (rows stored under it are done too: an upgrade sends nothing again)."""
        pin = llm.identity_endpoint if self.identity_endpoint is None else self.identity_endpoint
        return identity_scopes(
            llm.base_url, llm.api_version, provider=llm.provider, pin_endpoint=pin
        )


class PartitionRun:
    """Runs one partition. Rows are durable as they arrive; ok rows with the same hash are skipped."""

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
        *,
        run_id: str | None = None,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        max_write_rows: int = DEFAULT_MAX_WRITE_ROWS,
    ) -> None:
        self.spec = spec
        self.llm = llm
        self.db = session
        self.where = where
        self.partition_key = partition_key
        self.log = log
        self.run_id = run_id
        self.lease_ttl_s = lease_ttl_s
        self.max_write_rows = max(max_write_rows, spec.chunk_rows)
        self.model = spec.model or llm.model
        self.price: Price | None = None  # priced when the engine opens (_priced)
        self.served_model: str | None = None
        settings = llm.engine_settings(model=spec.model, params=spec.params)
        self.max_prompt_chars = spec.prompt.max_chars_for(settings.context_window)
        self.reuse = reuses_answers(spec.reuse_answers, settings.params)
        self.stats = RunStats(cost_usd=None)
        self.scope = f"{warehouse_identity}|{spec.output.name}"
        self.journal_dir = journal_dir or default_journal_dir()
        self.journal: ResultJournal | None = None
        self.lease: PartitionLease | None = None
        self.typed = spec.output_schema
        self._flush_turn: Any = lambda: None  # set by _accept
        self.sharing: Sharing | None = None  # set by _consume
        self.reader = SliceReader(
            spec, llm, session, where, partition_key, self.stats, self.max_prompt_chars
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
        assert self.journal is not None
        recovered = 0
        for chunk in self.journal.recover_chunks(self.spec.chunk_rows):
            rows_ = [storable_row(r) for r in chunk]
            write_storable(lambda rs: self.db.write_results(self.spec.output, rs), rows_)
            recovered += len(chunk)
        if recovered:
            self.log.info(
                f"partition {self.partition_key}: recovered {recovered} results of a run "
                "that stopped before writing them"
            )
        self.journal.clear()
        self.reader.nothing_done = not self.db.has_output(self.spec.output.name, self.partition_key)

    # -- answers -----------------------------------------------------------------------------
    def _row(self, r: ChatResult, now: datetime) -> dict[str, Any]:
        cost = result_cost(self.price, r)  # at the rates of the tier that answered
        self.stats.add(r, cost)
        self.served_model = served_model(self.model, r.model, self.served_model, self.log)
        row = {
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
            "request_hash": self.reader.hashes.pop(r.id, None),
            "service_tier": r.service_tier,
            "completed_at": now,
        }
        # Only text the provider sent (or our error text) can be unstorable; counts are ints.
        for k in _TEXT_FIELDS:
            v = row[k]
            if v is not None and (type(v) is not str or not v.isascii()):
                row[k] = storable(v)
        if self.typed:
            row.update(storable_row(self.typed.result_values(r.ok, r.response)))
        return row

    def _deliverer(
        self, writer: ChunkWriter, failed: asyncio.Future[BaseException], engine: Any
    ) -> Callable[[list[dict[str, Any]]], None]:
        """Rows to the writer, then to the journal in one write. A journal that cannot be
        written (`failed`) stops the sending at once; the answers of the requests already on
        the wire are paid, so they still come in and are kept in memory for the warehouse."""
        journal = self.journal
        assert journal is not None

        def deliver(rows: list[dict[str, Any]]) -> None:
            writer.extend(rows)  # in memory first: a journal that fails loses nothing received
            if failed.done():
                return
            journal.extend(rows)
            try:
                journal.flush()
            except Exception as exc:
                failed.set_result(exc)
                engine.breaker.stop("the result journal cannot be written")

        return deliver

    def _accept(self, writer: ChunkWriter, deliver: Callable[[list[dict[str, Any]]], None]) -> Any:
        """The workers' hook: each answer is taken the moment it is parsed. The answers of one
        event-loop turn become rows together at its end (a tight loop: about a third of the
        per-answer cost when interleaved with the workers' sends), with the rows of the
        followers that waited for them (sharing.py), and are delivered in one journal write."""
        sharing = self.sharing
        assert sharing is not None
        loop = asyncio.get_running_loop()
        turn: list[ChatResult] = []

        def flush() -> None:
            if not turn:
                return
            now = datetime.now(UTC)  # the answers of a turn arrived within it
            rows: list[dict[str, Any]] = []
            for r in turn:
                rows.append(self._row(r, now))
                rows += sharing.answered(rows[-1], writer.added + len(rows) - 1)
            turn.clear()
            deliver(rows)

        def on_result(r: ChatResult) -> None:
            if not turn:
                loop.call_soon(flush)
            turn.append(r)

        self._flush_turn = flush
        return on_result

    async def _consume(
        self,
        engine: Any,
        writer: ChunkWriter,
        started: float,
        failed: asyncio.Future[BaseException],
    ) -> None:
        last_log = started
        next_pct = 10
        deliver = self._deliverer(writer, failed, engine)
        self.sharing = Sharing(
            partition_key=self.partition_key,
            hashes=self.reader.hashes,
            writer=writer,
            deliver=deliver,
            lookup=stored_answers(self.db, self.spec.output, self.partition_key, self.reuse),
            stats=self.stats,
            stored_may_match=self.reuse or not self.reader.nothing_done,
        )
        # The reader hashes the exact body this engine sends; identical ones are sent once.
        requests = _until(self.sharing.requests(self.reader.chunks(engine)), failed)
        stream = engine.map(requests, on_result=self._accept(writer, deliver))
        async with contextlib.aclosing(stream) as results:
            async for _ in results:
                await writer.room()
                now = time.monotonic()
                pct = 100 * self.stats.processed / max(1, self.stats.rows_in)
                if pct >= next_pct or now - last_log >= PROGRESS_EVERY_S:
                    self._progress(now - started)
                    last_log = now
                    next_pct = (int(pct) // 10 + 1) * 10
        self.stats.aborted = engine.aborted_reason
        self.stats.budget = engine.budget.report() if engine.budget is not None else None
        self.stats.rate_limit_wait_s = engine.limiter_wait_s  # wall time, not a sum over rows

    async def _run(self) -> None:
        started = time.monotonic()
        assert self.journal is not None and self.lease is not None
        writer = ChunkWriter(
            lambda rows: self.db.write_results(self.spec.output, rows),
            self.journal,
            interval_s=getattr(self.db, "write_interval_s", DEFAULT_WRITE_INTERVAL_S),
            max_rows=self.max_write_rows,
            before_write=self.lease.check,
            last_answer_eta=lambda: self._last_answer_eta(started),
        )
        failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        spec = self.spec
        async with self.llm.engine(
            model=spec.model, params=spec.params, priced=self._priced
        ) as engine:
            consumer = asyncio.create_task(self._consume(engine, writer, started, failed))
            writing = asyncio.create_task(writer.run())
            try:
                await asyncio.wait({consumer, writing}, return_when=asyncio.FIRST_COMPLETED)
                self._flush_turn()  # answers of the last turn, if its end has not come yet
                if failed.done():
                    # The journal cannot be written: nothing more was sent, the answers of the
                    # requests that were on the wire came in; all are written now.
                    await write_what_arrived(writer, writing)
                    raise failed.result()
                if writing.done():  # the writer only ends early when a write failed
                    raise self._write_failed(writing.exception())
                if consumer.exception() is None:
                    await writer.close()
                    try:
                        await writing  # everything received is written
                    except Exception as exc:
                        raise self._write_failed(exc) from None
                else:
                    # The reader, the journal or the consumer failed: stop sending, keep what
                    # arrived (written now if the warehouse takes it, else in the journal).
                    await write_what_arrived(writer, writing)
                    consumer.result()
            finally:
                self.reader.stop()
                failed.cancel()
                # Again after 2 s only: the engine's own stop (its workers cancelled, again
                # each second, then its source closed) runs in the consumer's task.
                await cancel_and_wait((consumer, writing), every_s=2.0)
        self.journal.clear()  # everything is in the warehouse now
        self.stats.wall_s = time.monotonic() - started

    def _priced(self) -> Cost | None:
        """The run's price, once the engine knows its server: pricing follows what it is, not
        its host, and so is the model it serves (a different one was warned about then: the
        answers naming it are not warned again). The cost of a request, for the spend caps."""
        self.price = price_for_resource(self.llm, self.model, logger=self.log)
        self.stats.cost_usd = 0.0 if self.price is not None else None
        self.served_model = self.llm.served_name(self.model)
        return functools.partial(cost_usd, self.price) if self.price is not None else None

    def _last_answer_eta(self, started: float) -> float | None:
        """Seconds until the last answer at the rate so far (None before there is one)."""
        done = self.stats.ok + self.stats.failed
        left = self.stats.rows_in - self.stats.processed
        elapsed = time.monotonic() - started
        if done < 1 or left <= 0 or elapsed <= 0:
            return None
        return left / (done / elapsed)

    def _write_failed(self, exc: BaseException | None) -> BaseException:
        if exc is None or isinstance(exc, E.BatchLLMError):
            return exc or RuntimeError("the writer stopped")
        journal = self.journal.path.parent if self.journal else "the journal"
        return E.BatchLLMError(
            description=f"Writing results to {self.spec.output.name} failed: "
            f"{type(exc).__name__}: {str(exc)[:500]}. Sending stopped; every answer received is "
            f"kept in the result journal ({journal}) and is written by the next run of "
            f"partition {self.partition_key!r}."
        )

    def _progress(self, elapsed: float) -> None:
        self.log.info(f"partition {self.partition_key}: {progress_text(self.stats, elapsed)}")

    def run(self) -> RunStats:
        """Lease the partition, recover and check, then run; the lease is held throughout."""
        journal = ResultJournal(self.journal_dir, self.scope, self.partition_key)
        with partition_lease(
            name=journal.key,
            label=f"{self.partition_key!r} of {self.spec.output.name}",
            run_id=self.run_id,
            lock_dir=self.journal_dir,
            redis_url=self.llm.redis_url,
            store=self.db.lease_store(self.spec.output.name),
            ttl_s=self.lease_ttl_s,
        ) as lease:
            self.lease = lease
            self.journal = journal
            try:
                self.preflight()
                with frozen_heap():
                    asyncio.run(self._run())
            finally:
                journal.close()
        return self.stats


async def _until(
    requests: AsyncIterator[Any], failed: asyncio.Future[BaseException]
) -> AsyncIterator[Any]:
    """The requests, until the journal fails: then the workers finish what they hold."""
    async with contextlib.aclosing(requests):
        async for req in requests:
            if failed.done():
                return
            yield req
