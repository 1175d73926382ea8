"""Batch mode: one partition's pending rows through the provider's Batch API, exactly once.

The order of durable steps makes a killed run safe to relaunch:
1. upload the input file; 2. record the file in the state table (state `uploaded`, with the
rows' request identities); 3. create the batch with `metadata.bla_intent` = the record's id;
4. mark the record `submitted` with the batch id; 5. when the batch ends, write its lines to the
output table; 6. mark the record `collected`.
A relaunch finds an `uploaded` record whose batch may exist (a kill between 3 and 4): it lists
the provider's batches back to the input file's upload for that intent or that file, and adopts
the batch, or creates it if none exists. Rows of `uploaded`/`submitted` records are never sent
again; rows a batch did not reach (expired, cancelled) go back to pending and are sent in a new
batch, at most `max_resubmits` times; then they fail with the provider's reason.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from ..engine import errors as E
from ..engine.batch_api import TERMINAL, BatchAPIError, BatchClient, BatchLine, split_files
from ..resources.llm import LLMResource
from ..warehouses.base import SliceFilter, WarehouseSession
from .batch_budget import BatchBudget
from .batch_pending import PendingLines
from .batch_results import (
    UNREACHED,
    BatchRows,
    BatchSettings,
    BatchStats,
    custom_id,
    failure,
    state_table_for,
)
from .pipeline import RunSpec

OPEN_STATES = ("uploaded", "submitted")
__all__ = ["BatchPartitionRun", "BatchSettings", "custom_id", "state_table_for"]


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
        self.state_table = state_table_for(spec.output.name)
        model = llm.engine_settings(model=spec.model, params=spec.params).model
        self.rows = BatchRows(
            llm, model, partition_key, settings.price_factor, typed=spec.output_schema
        )
        self.lines = PendingLines(
            spec,
            llm,
            session,
            where,
            partition_key=partition_key,
            state_table=self.state_table,
            asset=asset,
            rows=self.rows,
        )
        self.model, self.max_tokens = self.lines.model, self.lines.max_tokens
        self.stats = self.rows.stats
        self.finalized = self.lines.finalized  # ids this run wrote or found done
        self._provider_full = False
        self._rescan = True
        self._queue: list[BatchLine] = []
        self.budget = BatchBudget(self)  # spend caps (batch_budget.py)

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> BatchStats:
        started = time.monotonic()
        self.preflight()
        asyncio.run(self.budget.around(self._run()))
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
                    self._queue = await asyncio.to_thread(self.lines.scan)
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
            batch = await self.client.find(
                tag=("bla_intent", record["intent_id"]),
                input_file_id=record["file_id"],
                not_before=await self.client.file_created_at(record["file_id"]),
            )
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
            await self.budget.submitted(record)
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

    # -- submission ------------------------------------------------------------------------
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
            if not (group := await self.budget.fit(group)):  # the caps' room, held
                break
            await self._submit_file(group, sum(line.tokens for line, _ in group))
            sent += len(group)
        self._queue = await self.budget.left_over(self._queue[sent:], self.lines)
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
            "items": json.dumps(self.lines.record_items([ln for ln, _ in group]), default=str),
            "n_requests": len(group),
            "tokens": tokens,
            "created_at": now,
        }
        await self._put(record)  # durable before the provider hears of the batch
        batch = await self.client.create(file_id, self._metadata(record))
        await self.budget.submitted(record)
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
    async def _unreached_before(self, record: dict[str, Any]) -> Counter[str]:
        """custom_id -> how many other expired or cancelled batches of the partition held it."""
        earlier: Counter[str] = Counter()
        for s in await self._states():
            if s["intent_id"] != record["intent_id"] and s["provider_status"] in UNREACHED:
                earlier.update(json.loads(s["items"]).keys())
        return earlier

    async def _collect(self, record: dict[str, Any], batch: dict[str, Any], queued: float) -> None:
        items: dict[str, list[Any]] = json.loads(record["items"])
        status = batch["status"]
        records = []
        if status == "failed":  # a full provider queue returns the rows to pending, for later
            self._provider_full |= failure(batch)[0] == "token_limit_exceeded"
        else:
            records = await self.client.lines(batch.get("output_file_id"))
            records += await self.client.lines(batch.get("error_file_id"))
        rows = self.rows.collected(
            batch,
            items,
            records,
            secret=self.llm.api_key,
            max_tokens=self.max_tokens,
            unreached_before=await self._unreached_before(record) if status in UNREACHED else None,
            max_resubmits=self.s.max_resubmits,
        )
        for i in range(0, len(rows), self.spec.chunk_rows):
            chunk = rows[i : i + self.spec.chunk_rows]
            await asyncio.to_thread(self.db.write_results, self.spec.output, chunk)
        self.finalized.update(r["id"] for r in rows)
        await self.budget.collected(record, rows)
        await self._put(record, state="collected", provider_status=status)
        if batch["id"] not in self.stats.batch_ids:
            self.stats.batch_ids.append(batch["id"])
        self.stats.queue_s.append(queued)
        back = len(items) - len(rows)
        self._rescan = self._rescan or back > 0 or self.lines.deferred
        self.log.info(
            f"partition {self.partition_key}: batch {batch['id']} {status} after {queued:.0f} s "
            f"in queue: {len(rows)} rows written" + (f", {back} go back to pending" if back else "")
        )
