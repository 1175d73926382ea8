"""What batch lines become: output rows at the batch price, stats, and the run's metadata."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from ..engine import errors as E
from ..engine.batch_api import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_FILE_REQUESTS,
    LineResult,
    parse_output_line,
)
from ..engine.engine import ChatResult
from ..engine.outcome import classify_answer
from ..engine.transport import parse_completion
from ..resources.llm import LLMResource
from ..warehouses.base import SliceFilter, Warehouse, check_table
from .checks import PartitionOutcome, check_results, failure_reason, judge_partition
from .journal import default_journal_dir, journal_key
from .lease import partition_lease
from .metadata import Limits, RunStats, build_metadata
from .pipeline import RunSpec
from .pricing import BATCH_PRICE_FACTOR, cost_usd, price_for_resource, pricing_label
from .sharing import follower_row
from .structured import OutputSchema, field_check_results, field_quality, quality_metadata

# A batch that ended before reaching a request: the request's error class once it is given up.
UNREACHED = {"expired": "batch_expired", "cancelled": "batch_cancelled"}


@dataclass(frozen=True)
class BatchSettings:
    """How batch mode splits, queues and waits. Keyword-built by the factory and the component."""

    wait: bool = True
    max_file_requests: int = DEFAULT_MAX_FILE_REQUESTS
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    enqueued_token_limit: int | None = None
    poll_first_s: float = 2.0
    poll_max_s: float = 300.0
    price_factor: float = BATCH_PRICE_FACTOR
    max_resubmits: int = 3

    def __post_init__(self) -> None:
        for name in ("max_file_requests", "max_file_bytes", "poll_first_s", "poll_max_s"):
            if not getattr(self, name) > 0:
                raise E.BatchLLMError(description=f"batch {name} must be > 0")
        if self.enqueued_token_limit is not None and self.enqueued_token_limit < 1:
            raise E.BatchLLMError(description="batch enqueued_token_limit must be >= 1 or None")
        if type(self.max_resubmits) is not int or self.max_resubmits < 0:
            raise E.BatchLLMError(description="batch max_resubmits must be an integer >= 0")
        if not 0 <= self.price_factor <= 1:
            raise E.BatchLLMError(description="batch price_factor must be within [0, 1]")


def state_table_for(output: str) -> str:
    """The state table beside the output table: `<output>__bla_batches`."""
    parts = check_table(output)
    return ".".join([*parts[:-1], parts[-1] + "__bla_batches"])


def custom_id(row_id: Any, rhash: str) -> str:
    """A row's identity in a batch: its id and request hash (the same work, the same id)."""
    return hashlib.sha256(json.dumps([str(row_id), rhash]).encode()).hexdigest()[:40]


def failure(batch: dict[str, Any]) -> tuple[str, str]:
    """(code, message) of a failed batch's first error."""
    errors = (batch.get("errors") or {}).get("data") or [{}]
    code = str(errors[0].get("code") or "batch_failed")
    return code, str(errors[0].get("message") or code)


@dataclass
class BatchStats(RunStats):
    batch_ids: list[str] = field(default_factory=list)
    batches_submitted: int = 0
    batches_open: int = 0
    queue_s: list[float] = field(default_factory=list)
    queued_rows: int = 0


class BatchRows:
    """Builds output rows (the live mode's columns) and counts them into the stats."""

    parse_body: Any = staticmethod(parse_completion)  # an output line's body -> its record

    def __init__(
        self,
        llm: LLMResource,
        model: str,
        partition_key: str,
        factor: float,
        *,
        typed: OutputSchema | None = None,
    ) -> None:
        self.typed = typed
        price = price_for_resource(llm, model, batch=True)
        if price is not None and price.source == "configured":
            # Configured prices are the live ones; the library's batch prices need no factor.
            price = dataclasses.replace(
                price,
                input_per_1m=price.input_per_1m * factor,
                output_per_1m=price.output_per_1m * factor,
                cached_input_per_1m=price.cached_input_per_1m * factor,
                batch=True,
            )
        self.price = price
        self.model, self.partition_key = model, partition_key
        self.stats = BatchStats(cost_usd=0.0 if self.price is not None else None)

    def collected(
        self,
        batch: dict[str, Any],
        items: dict[str, list[Any]],
        records: list[dict[str, Any]],
        **how: Any,
    ) -> list[dict[str, Any]]:
        """The rows of an ended batch (`answered`), and the rows that take a line's answer
        (items of three: row id, identity, the line's custom_id), as in live mode."""
        lines = {cid: item for cid, item in items.items() if len(item) == 2}
        rows = self.answered(batch, lines, records, **how)
        by_id = {row["id"]: row for row in rows}
        now = datetime.now(UTC)
        for rid, _, leader in (item for item in items.values() if len(item) == 3):
            source = by_id.get(lines[leader][0])
            if source is not None:  # else the line goes back to pending, and its rows with it
                rows.append(
                    follower_row(
                        source,
                        rid,
                        partition_key=self.partition_key,
                        now=now,
                        stats=self.stats,
                        reused=False,
                    )
                )
        return rows

    def answered(
        self,
        batch: dict[str, Any],
        items: dict[str, list[Any]],
        records: list[dict[str, Any]],
        *,
        secret: str,
        max_tokens: int,
        unreached_before: Counter[str] | None,
        max_resubmits: int,
    ) -> list[dict[str, Any]]:
        """The rows of an ended batch's lines: its output and error lines; every request of a
        failed batch failed with its reason (none when the provider's queue was full: they go
        back to pending). The requests an expired or cancelled batch did not reach go back to
        pending too, unless they were already in `max_resubmits` such batches
        (`unreached_before`): then they fail with its reason."""
        if batch["status"] == "failed":
            code, reason = failure(batch)
            if code == "token_limit_exceeded":
                return []
            reason = E.redact(reason, secret)
            message = f"batch {batch['id']} failed: {reason}"
            return [self.failed(i, h, code, message) for i, h in items.values()]
        rows, reached = [], set()
        for rec in records:
            line = parse_output_line(rec, secret, self.parse_body)
            if line.custom_id in items and line.processed:
                reached.add(line.custom_id)
                rid, rhash = items[line.custom_id]
                rows.append(self.line(rid, rhash, line, max_tokens=max_tokens))
        status = batch["status"]
        for cid, (rid, rhash) in items.items():
            if unreached_before is None or cid in reached:
                continue
            n = unreached_before[cid] + 1
            if n > max_resubmits:
                rows.append(
                    self.failed(
                        rid,
                        rhash,
                        UNREACHED[status],
                        f"{n} batches in a row ended {status} before reaching this request "
                        f"(the last: {batch['id']}); not submitted again "
                        f"(max_resubmits={max_resubmits})",
                    )
                )
        return rows

    def line(
        self,
        rid: Any,
        rhash: str,
        line: LineResult,
        *,
        max_tokens: int,
        tools_allowed: bool = False,
    ) -> dict[str, Any]:
        """An output or error-file line, parsed and judged as the live path judges an answer
        (truncated, refusal, content_filter, ... fail the row with their reason)."""
        resp = line.response
        if resp is None:
            return self.failed(
                rid, rhash, line.error_class or E.SERVER_ERROR, line.error_message or "", attempts=1
            )
        verdict = classify_answer(resp, tools_allowed=tools_allowed, max_tokens=max_tokens)
        status, error_class, message = verdict.status, verdict.error_class, verdict.message
        if self.typed is not None and (verdict.ok or error_class == "truncated"):
            try:  # typed outputs: validated as live answers are (a batch has no repair turn)
                self.typed.parse(resp.content)
            except ValueError as exc:
                status, error_class, message = "failed", E.INVALID_OUTPUT, str(exc)
            else:
                status, error_class, message = "ok", None, None
        result = ChatResult(
            rid,
            status,
            response=verdict.response if verdict.response is not None else resp.content,
            finish_reason=resp.finish_reason,
            refusal=resp.refusal,
            error_class=error_class,
            error_message=message,
            prompt_tokens=resp.prompt_tokens,
            completion_tokens=resp.completion_tokens,
            attempts=1,
        )
        return self.row(result, rhash)

    def failed(
        self, rid: Any, rhash: str | None, error_class: str, message: str, *, attempts: int = 0
    ) -> dict[str, Any]:
        """A failed row; `attempts` 0 for a request the provider never processed."""
        result = ChatResult(
            rid, "failed", error_class=error_class, error_message=message, attempts=attempts
        )
        return self.row(result, rhash)

    def row(self, r: ChatResult, rhash: str | None) -> dict[str, Any]:
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
            "finish_reason": r.finish_reason,
            "refusal": r.refusal,
            "latency_ms": None,  # a batch line has no per-request latency; see batch_queue_max_s
            "total_ms": None,
            "attempts": r.attempts,
            "request_hash": rhash,
            "completed_at": datetime.now(UTC),
            **(self.typed.result_values(r.ok, r.response) if self.typed else {}),
        }


def materialize_batch_partition(
    context: dg.AssetExecutionContext,
    spec: RunSpec,
    llm: LLMResource,
    warehouse: Warehouse,
    where: SliceFilter,
    partition_key: str,
    *,
    settings: BatchSettings,
    max_failed_fraction: float,
    checks: bool = True,
    warn_failed_fraction: float,
    run_class: type | None = None,
) -> dg.MaterializeResult:
    """The asset body in batch mode: run the partition with `run_class` (None: the chat
    BatchPartitionRun), then metadata and the failure check."""
    from .batch_mode import BatchPartitionRun

    with warehouse.session() as session:
        run = (run_class or BatchPartitionRun)(
            spec,
            llm,
            session,
            where,
            partition_key,
            context.log,
            asset=context.asset_key.to_user_string(),
            settings=settings,
            run_id=context.run_id,
        )
        stats, summary, quality = _run_leased(
            context, run, spec, llm, warehouse, session, partition_key
        )
    output = spec.output.name
    metadata = build_metadata(
        stats,
        summary=summary,
        model=run.model,
        output=output,
        partition_key=partition_key,
        limits=Limits(rpm=llm.rpm, tpm=llm.tpm),
        pricing=pricing_label(getattr(run, "price", None)),
    )
    metadata.update(batch_metadata(stats, settings))
    # With batches still open the checks say what the output holds now (rows still queued are
    # missing); the completion sensor's materialisation checks the partition again.
    metadata.update(quality_metadata(quality))  # typed outputs: NULL fraction per field
    results = (
        [
            *check_results(summary, stats.rows_in, warn_failed_fraction=warn_failed_fraction),
            *field_check_results(context.asset_key, quality, warn_failed_fraction),
        ]
        if checks
        else []
    )
    _judge(context, partition_key, summary, stats, metadata, results, max_failed_fraction)
    return dg.MaterializeResult(metadata=metadata, check_results=results)


def _run_leased(
    context: dg.AssetExecutionContext,
    run: Any,
    spec: RunSpec,
    llm: LLMResource,
    warehouse: Warehouse,
    session: Any,
    partition_key: str,
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Run the partition under the live mode's lease (one run of a partition at a time, live or
    batch, so two runs never submit the same pending rows); its stats, summary and typed
    fields' quality."""
    output = spec.output.name
    try:
        lock_dir = default_journal_dir()
        lock_dir.mkdir(parents=True, exist_ok=True)
        with partition_lease(
            name=journal_key(f"{warehouse.identity()}|{output}", partition_key),
            label=f"{partition_key!r} of {output}",
            run_id=context.run_id,
            lock_dir=lock_dir,
            redis_url=llm.redis_url,
            store=session.lease_store(output),
        ):
            stats = run.run()
        summary = session.partition_summary(output, partition_key)
        typed = spec.output_schema
        quality = field_quality(session, output, partition_key, typed.names) if typed else {}
    except E.BatchLLMError as exc:
        raise dg.Failure(description=exc.description, metadata=exc.metadata) from None
    return stats, summary, quality


def _judge(
    context: dg.AssetExecutionContext,
    partition_key: str,
    summary: dict[str, Any],
    stats: BatchStats,
    metadata: dict[str, Any],
    results: list[dg.AssetCheckResult],
    max_failed_fraction: float,
) -> None:
    """Fail a bad partition, after recording its check evaluations. With batches still open
    (wait=False) rows still queued are not failures yet; a spend cap fails it all the same."""
    stop = stats.budget_stop
    if stats.batches_open and not stop:
        return
    kw = {"max_failed_fraction": max_failed_fraction, "aborted": stats.aborted, "budget": stop}
    why = failure_reason(summary, stats.rows_in, **kw)
    if why is not None:  # a failed partition is checked too (its evaluations, then fail)
        key = partition_key if context.has_partition_key else None
        for event in PartitionOutcome(key, metadata, results, why).events(context.asset_key):
            context.log_event(event)
        judge_partition(summary, stats.rows_in, metadata=metadata, **kw)


def batch_metadata(stats: BatchStats, settings: BatchSettings) -> dict[str, Any]:
    """What batch mode adds to the live metadata: its batches and how long they queued."""
    queue = sorted(stats.queue_s)
    return {
        "mode": dg.MetadataValue.text("batch"),
        "batch_ids": dg.MetadataValue.json(stats.batch_ids),
        "batches_submitted": dg.MetadataValue.int(stats.batches_submitted),
        "batches_open": dg.MetadataValue.int(stats.batches_open),
        "rows_queued": dg.MetadataValue.int(stats.queued_rows),
        "batch_queue_max_s": dg.MetadataValue.float(round(queue[-1], 1) if queue else 0.0),
        "batch_price_factor": dg.MetadataValue.float(settings.price_factor),
    }
