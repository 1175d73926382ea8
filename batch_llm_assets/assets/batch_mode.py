"""Batch mode: one partition's pending rows through the provider's Batch API, exactly once.

The order of durable steps makes a killed run safe to relaunch:
1. upload the input file; 2. record the file in the state table (state `uploaded`, with the
rows' request identities); 3. create the batch with `metadata.bla_intent` = the record's id;
4. mark the record `submitted` with the batch id; 5. when the batch ends, write its lines to the
output table; 6. mark the record `collected`.
A relaunch finds an `uploaded` record whose batch may exist (a kill between 3 and 4): it lists
the provider's batches for that intent and adopts the batch, or creates it if none exists. Rows
of `uploaded`/`submitted` records are never sent again; rows a batch did not reach (expired,
cancelled) go back to pending and are sent in a new batch.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ..engine import errors as E
from ..engine.batch_api import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_FILE_REQUESTS,
    TERMINAL,
    BatchAPIError,
    BatchClient,
    BatchLine,
    parse_output_line,
    split_files,
)
from ..engine.identity import request_identity
from ..engine.structured import provider_kind
from ..engine.tokens import count_prompt_tokens, requested_max_tokens
from ..resources.llm import LLMResource
from ..warehouses.base import SliceFilter, WarehouseSession, check_table
from .batch_results import BATCH_PRICE_FACTOR, BatchRows, BatchStats
from .pipeline import RunSpec

OPEN_STATES = ("uploaded", "submitted")


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

    def __post_init__(self) -> None:
        for name in ("max_file_requests", "max_file_bytes", "poll_first_s", "poll_max_s"):
            if not getattr(self, name) > 0:
                raise E.BatchLLMError(description=f"batch {name} must be > 0")
        if self.enqueued_token_limit is not None and self.enqueued_token_limit < 1:
            raise E.BatchLLMError(description="batch enqueued_token_limit must be >= 1 or None")
        if not 0 <= self.price_factor <= 1:
            raise E.BatchLLMError(description="batch price_factor must be within [0, 1]")


def state_table_for(output: str) -> str:
    """The state table beside the output table: `<output>__bla_batches`."""
    parts = check_table(output)
    return ".".join([*parts[:-1], parts[-1] + "__bla_batches"])


def custom_id(row_id: Any, rhash: str) -> str:
    """A row's identity in a batch: its id and request hash (the same work, the same id)."""
    return hashlib.sha256(json.dumps([str(row_id), rhash]).encode()).hexdigest()[:40]


class BatchPartitionRun:
    """One partition in batch mode: collect what finished, submit what is pending, maybe wait."""

    def __init__(
        self,
        spec: RunSpec,
        llm: LLMResource,
        session: WarehouseSession,
        where: SliceFilter,
        partition_key: str,
        log: Any,
        *,
        asset: str,
        settings: BatchSettings,
        run_id: str = "",
    ) -> None:
        self.spec, self.llm, self.db, self.where = spec, llm, session, where
        self.partition_key, self.log, self.asset, self.s = partition_key, log, asset, settings
        self.run_id = run_id
        engine = llm.engine_settings(model=spec.model, params=spec.params)
        self.model, self.params = engine.model, engine.params
        self.max_tokens = requested_max_tokens(self.params, engine.default_max_tokens)
        self.window = engine.context_window
        self.state_table = state_table_for(spec.output.name)
        self.rows = BatchRows(
            llm, self.model, partition_key, settings.price_factor, typed=spec.output_schema
        )
        # Typed outputs: asked for in the provider's form, validated per line (no repair turn).
        self.provider_kind = provider_kind(
            llm.base_url, api_version=llm.api_version, provider=getattr(llm, "provider", None)
        )
        self.stats = self.rows.stats
        self.finalized: set[Any] = set()  # ids this run wrote or found done: not sent again
        self._provider_full = False
        self._rescan = True
        self._queue: list[BatchLine] = []
        self._items: dict[str, tuple[Any, str]] = {}

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> BatchStats:
        started = time.monotonic()
        self.preflight()
        asyncio.run(self._run())
        self.stats.wall_s = time.monotonic() - started
        return self.stats

    def preflight(self) -> None:
        src = self.spec.source
        self.db.check_source(src)
        rows, dups, null_ids = self.db.slice_stats(src, self.where)
        if dups or null_ids:
            raise E.BatchLLMError(
                description=f"{src.table!r} partition {self.partition_key!r} has duplicate "
                f"(e.g. {dups}) or {null_ids} NULL ids in {src.id_column!r}: results are keyed "
                "by id, so nothing was sent."
            )
        self.stats.rows_in = rows
        self.db.ensure_output(self.spec.output, src)
        self.db.ensure_batch_state(self.state_table)

    async def _run(self) -> None:
        async with BatchClient(
            base_url=self.llm.base_url, api_key=self.llm.api_key, api_version=self.llm.api_version
        ) as client:
            self.client = client
            delay = self.s.poll_first_s
            while True:
                states = await self._states()
                await self._recover(states)
                await self._refresh([s for s in states if s["state"] == "submitted"])
                if self._rescan:  # the slice is read again only when rows may be pending
                    self._rescan = False
                    self._queue = await asyncio.to_thread(self._pending)
                await self._submit()
                open_ = [s for s in await self._states() if s["state"] in OPEN_STATES]
                self.stats.batches_open = len(open_)
                if not self.s.wait or not (open_ or self.stats.queued_rows):
                    return
                await asyncio.sleep(delay)
                delay = min(self.s.poll_max_s, delay * 1.5)
                self._provider_full = False  # the provider's queue may have room again

    async def _states(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(
            self.db.batch_states, self.state_table, self.asset, self.partition_key
        )

    async def _put(self, record: dict[str, Any], **changes: Any) -> None:
        record.update(changes, updated_at=datetime.now(UTC))
        await asyncio.to_thread(self.db.put_batch_state, self.state_table, record)

    async def _recover(self, states: list[dict[str, Any]]) -> None:
        """Uploaded but not known as submitted: adopt the batch the provider has, or create it."""
        for record in (s for s in states if s["state"] == "uploaded"):
            batch = await self.client.find("bla_intent", record["intent_id"])
            if batch is None:
                try:
                    batch = await self.client.create(record["file_id"], self._metadata(record))
                except BatchAPIError as exc:
                    if exc.metadata.get("retryable", True):
                        raise  # unclear whether it was created: the next run looks again
                    # Refused (e.g. the file is gone): never submitted, so its rows are pending.
                    self.log.warning(f"partition {self.partition_key}: {exc.description}")
                    await self._put(record, state="collected", provider_status="not_submitted")
                    self._rescan = True
                    continue
            else:
                self.log.info(f"partition {self.partition_key}: adopted batch {batch['id']}")
            await self._put(
                record, batch_id=batch["id"], state="submitted", provider_status=batch["status"]
            )

    async def _refresh(self, submitted: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Collect the batches that ended; log progress of the others; return those."""
        still_open = []
        for record in submitted:
            batch = await self.client.retrieve(record["batch_id"])
            counts = batch.get("request_counts") or {}
            age = time.time() - float(batch.get("created_at") or time.time())
            if batch["status"] in TERMINAL:
                ended = next(
                    (
                        batch.get(f"{k}_at")
                        for k in ("completed", "expired", "cancelled", "failed")
                        if batch.get(f"{k}_at")
                    ),
                    None,
                )
                queued = (ended or time.time()) - float(batch.get("created_at") or 0)
                await self._collect(record, batch, queued)
                continue
            self.log.info(
                f"partition {self.partition_key}: batch {batch['id']} {batch['status']}, "
                f"{counts.get('completed', 0)} completed / {counts.get('failed', 0)} failed / "
                f"{counts.get('total', record['n_requests'])} total, in queue {age:.0f} s"
            )
            still_open.append(record)
        return still_open

    # -- pending rows and submission ---------------------------------------------------------
    def _pending(self) -> list[BatchLine]:
        """Rows not ok with the same request, not in an open batch, not written by this run."""
        src = self.spec.source
        in_flight: set[str] = set()
        open_ = self.db.batch_states(
            self.state_table, self.asset, self.partition_key, open_only=True
        )
        for record in open_:
            in_flight.update(json.loads(record["items"]))
        lines: list[BatchLine] = []
        failed: list[dict[str, Any]] = []
        self._items = {}
        nothing_done = not self.db.has_output(self.spec.output.name, self.partition_key)
        for chunk in self.db.read_slice(src, self.where, self.spec.chunk_rows):
            ids = [r[src.id_column] for r in chunk]
            done = (
                {}
                if nothing_done
                else self.db.done_hashes(self.spec.output, self.partition_key, ids)
            )
            for row in chunk:
                rid = row[src.id_column]
                if rid in self.finalized:
                    continue
                if not isinstance(rid, int | str):
                    raise E.BatchLLMError(
                        description=f"Batch mode needs integer or string ids; {src.id_column!r} "
                        f"of {src.table!r} holds {type(rid).__name__} values. Use live mode or "
                        "an integer or string id column."
                    )
                messages, problem = self.spec.prompt.render(row)
                if problem is not None:
                    self.finalized.add(rid)
                    failed.append(
                        self.rows.failed(rid, None, problem[0], f"{problem[1]}; not sent")
                    )
                    continue
                typed = self.spec.output_schema
                shaped: dict[str, Any] = {}
                if typed is not None:
                    shaped, messages = typed.shape(self.provider_kind, messages)
                body = {**self.params, **shaped, "model": self.model, "messages": messages}
                if "max_tokens" not in body and "max_completion_tokens" not in body:
                    body["max_tokens"] = self.max_tokens
                rhash = request_identity(body, self.llm.base_url, self.llm.api_version)
                cid = custom_id(rid, rhash)
                if done.get(rid) == rhash:
                    self.stats.skipped += 1
                    self.finalized.add(rid)
                    continue
                if cid in in_flight:
                    continue
                tokens = count_prompt_tokens(messages, self.model) + self.max_tokens
                if self.window and tokens > self.window:
                    self.finalized.add(rid)
                    failed.append(
                        self.rows.failed(
                            rid,
                            rhash,
                            E.CONTEXT_LENGTH,
                            f"prompt + max_tokens is about {tokens} tokens, over the model's "
                            f"context window of {self.window}; not sent",
                        )
                    )
                    continue
                self._items[cid] = (rid, rhash)
                lines.append(BatchLine(cid, body, tokens))
        for i in range(0, len(failed), self.spec.chunk_rows):
            self.db.write_results(self.spec.output, failed[i : i + self.spec.chunk_rows])
        return lines

    async def _submit(self) -> None:
        """Submit the queue file by file; stop (and wait) at the enqueued-token limit."""
        limit = self.s.enqueued_token_limit
        files = split_files(
            self._queue,
            max_requests=self.s.max_file_requests,
            max_bytes=self.s.max_file_bytes,
            max_tokens=limit,
        )
        sent = 0
        for group in files:
            tokens = sum(line.tokens for line, _ in group)
            if limit is not None or self._provider_full:
                enqueued = await asyncio.to_thread(self._enqueued_tokens)
                if self._provider_full or enqueued + tokens > (limit or 0):
                    self.log.info(
                        f"partition {self.partition_key}: {len(self._queue) - sent} requests "
                        f"wait: {enqueued} tokens already enqueued for {self.model} "
                        f"(limit {limit})"
                    )
                    break
            await self._submit_file(group, tokens)
            sent += len(group)
        self._queue = self._queue[sent:]
        self.stats.queued_rows = len(self._queue)

    def _enqueued_tokens(self) -> int:
        """Tokens of this asset's open batches for the model, across all its partitions."""
        return sum(
            int(r["tokens"] or 0)
            for r in self.db.batch_states(self.state_table, self.asset, open_only=True)
            if r["model"] == self.model
        )

    async def _submit_file(self, group: list[tuple[BatchLine, bytes]], tokens: int) -> None:
        file_id = await self.client.upload(b"".join(data for _, data in group))
        now = datetime.now(UTC)
        record: dict[str, Any] = {
            "asset": self.asset,
            "partition_key": self.partition_key,
            "intent_id": uuid.uuid4().hex,
            "file_id": file_id,
            "model": self.model,
            "state": "uploaded",
            "items": json.dumps(
                {ln.custom_id: list(self._items[ln.custom_id]) for ln, _ in group}, default=str
            ),
            "n_requests": len(group),
            "tokens": tokens,
            "created_at": now,
        }
        await self._put(record)  # durable before the provider hears of the batch
        batch = await self.client.create(file_id, self._metadata(record))
        await self._put(
            record, batch_id=batch["id"], state="submitted", provider_status=batch["status"]
        )
        self.stats.batches_submitted += 1
        self.stats.batch_ids.append(batch["id"])
        self.log.info(
            f"partition {self.partition_key}: submitted batch {batch['id']} "
            f"({len(group)} requests, about {tokens} tokens)"
        )

    def _metadata(self, record: dict[str, Any]) -> dict[str, str]:
        return {
            "bla_intent": record["intent_id"],
            "bla_run": self.run_id[:64],
            "bla_asset": self.asset[:64],
            "bla_partition": self.partition_key[:64],
        }

    # -- collecting --------------------------------------------------------------------------
    async def _collect(self, record: dict[str, Any], batch: dict[str, Any], queued: float) -> None:
        items: dict[str, list[Any]] = json.loads(record["items"])
        status = batch["status"]
        rows: list[dict[str, Any]] = []
        secret = self.llm.api_key
        if status == "failed":
            errors = (batch.get("errors") or {}).get("data") or [{}]
            code = str(errors[0].get("code") or "batch_failed")
            if code == "token_limit_exceeded":  # the provider's queue is full: send them later
                self._provider_full = True
            else:
                reason = E.redact(str(errors[0].get("message") or code), secret)
                rows = [
                    self.rows.failed(i, h, code, f"batch {batch['id']} failed: {reason}")
                    for i, h in items.values()
                ]
        else:
            records = await self.client.lines(batch.get("output_file_id"))
            records += await self.client.lines(batch.get("error_file_id"))
            for rec in records:
                line = parse_output_line(rec, secret)
                if line.custom_id in items and line.processed:
                    rid, rhash = items[line.custom_id]
                    rows.append(self.rows.line(rid, rhash, line, max_tokens=self.max_tokens))
        for i in range(0, len(rows), self.spec.chunk_rows):
            chunk = rows[i : i + self.spec.chunk_rows]
            await asyncio.to_thread(self.db.write_results, self.spec.output, chunk)
        self.finalized.update(r["id"] for r in rows)
        await self._put(record, state="collected", provider_status=status)
        if batch["id"] not in self.stats.batch_ids:
            self.stats.batch_ids.append(batch["id"])
        self.stats.queue_s.append(queued)
        back = len(items) - len(rows)
        self._rescan = self._rescan or back > 0
        self.log.info(
            f"partition {self.partition_key}: batch {batch['id']} {status} after {queued:.0f} s "
            f"in queue: {len(rows)} rows written" + (f", {back} go back to pending" if back else "")
        )
