"""Spend caps in batch mode (engine/budget.py): a file's worst case is held before it is
uploaded (the head of it that fits, if not all), charged once the provider has the batch, and
replaced by its real cost when it is collected, by whichever run collects it. What the caps
leave unsent is recorded `budget_exhausted`, for a rerun with more budget."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Coroutine
from datetime import UTC
from typing import TYPE_CHECKING, Any

from ..engine.batch_api import BatchLine
from ..engine.budget import BUDGET_EXHAUSTED, Hold, SpendCap
from ..resources.llm_engine import spend_cap
from .pricing import cost_usd

if TYPE_CHECKING:
    from .batch_mode import BatchPartitionRun
    from .batch_pending import PendingLines


class BatchBudget:
    """The caps of one batch-mode run; every method does nothing when the LLM resource sets
    no cap."""

    def __init__(self, run: BatchPartitionRun) -> None:
        self.run = run
        price = run.rows.price  # the batch price
        cost = functools.partial(cost_usd, price) if price is not None else None
        self.cap: SpendCap | None = spend_cap(run.llm, lambda: cost, model=run.model)
        self._hold: Hold | None = None  # the file about to be submitted
        self._open: set[str] = set()  # files charged, not collected yet: refunds to come

    async def around(self, run: Coroutine[Any, Any, None]) -> None:
        """`run` with the caps open (their Redis connected); their figures then in the stats."""
        if self.cap is None:
            return await run
        try:
            await self.cap.open()
            await run
        finally:
            await self.cap.aclose()
            self.run.stats.budget = self.cap.report()

    def _worst(self, requests: int, tokens: int) -> int:
        """A file's worst case: its prompts, and max_tokens per request out."""
        assert self.cap is not None
        out = requests * self.run.max_tokens
        return self.cap.worst(tokens - out, out)

    async def fit(self, group: list[tuple[BatchLine, bytes]]) -> list[tuple[BatchLine, bytes]]:
        """The head of a file's lines that fits the caps, held (all of them without a cap);
        none while nothing fits (the caps are then exhausted, unless refunds are due)."""
        if self.cap is None:
            return group
        worst = [self._worst(1, ln.tokens) for ln, _ in group]
        n, hold = await self.cap.hold_lines(worst, refunds_due=bool(self._open))
        self._hold = hold if isinstance(hold, Hold) else None
        return group[:n]

    async def submitted(self, record: dict[str, Any]) -> None:
        """The provider has the file's batch: charge its worst case (once, this run or not)."""
        if self.cap is not None:
            amount = self._worst(record["n_requests"], int(record["tokens"] or 0))
            await self.cap.charge(record["intent_id"], amount, self._hold)
            self._hold = None
            self._open.add(record["intent_id"])

    async def collected(self, record: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """The file's rows are written: their real cost replaces the file's charge."""
        if self.cap is not None:
            self._open.discard(record["intent_id"])
            real = sum(r["cost_usd"] or 0.0 for r in rows)
            created = record["created_at"]
            day = (created.astimezone(UTC) if created.tzinfo else created).date()
            await self.cap.refund(record["intent_id"], real, day)

    async def left_over(self, queue: list[BatchLine], lines: PendingLines) -> list[BatchLine]:
        """The queue once the caps stopped the submitting: its rows, and the rows that were to
        take their answers, are written failed `budget_exhausted`, none is left; else the
        queue."""
        if self.cap is None or self.cap.why is None or not queue:
            return queue
        run = self.run
        message = f"not sent: {self.cap.why}"
        ids = []
        for ln in queue:
            ids.append(lines.items[ln.custom_id])
            ids.extend((rid, rhash) for _, rid, rhash in lines.followers.get(ln.custom_id, ()))
        rows = [run.rows.failed(rid, rhash, BUDGET_EXHAUSTED, message) for rid, rhash in ids]
        for i in range(0, len(rows), run.spec.chunk_rows):
            chunk = rows[i : i + run.spec.chunk_rows]
            await asyncio.to_thread(run.db.write_results, run.spec.output, chunk)
        run.finalized.update(r["id"] for r in rows)
        return []
