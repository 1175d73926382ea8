"""The estimate's reading of partitions: each one's requests as its run would build them, counted
once per identity, less the answers already stored, without sending anything.

The rows are read and rendered by the run's own reader (reader.py), so the request bodies and
their identities (`request_hash`) are the ones the run sends; rows already done in the partition
are skipped there as in a run. Then, as sharing.py does in a run:
- a request identical to one earlier in the partition is shared, not sent;
- an answer stored `ok` under the identity (in this partition, or in any partition when the
  asset reuses answers) is reused; the output table is asked once per chunk;
- with reuse, a request counted in an earlier partition of the estimate is reused too: that
  partition's run stores its answer first.
Prompt tokens are counted with the engine's tokenizer over the messages that would be sent.
An asset in Batch API mode shares and reuses the same way (batch_pending.py): one line per
distinct request in its batch file.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

import dagster as dg

from ..engine.engine import ChatRequest, Engine
from ..engine.tokens import count_prompt_tokens
from ..resources.llm import LLMResource
from ..warehouses.base import WarehouseSession
from .metadata import RunStats
from .partitions import partition_source
from .pipeline import RunSpec
from .reader import SliceReader
from .sharing import Lookup, stored_answers
from .spec import LlmBatchSpec

# Rows read from one partition; past it the partition's first rows (in id order) stand for it.
SAMPLE_ROWS = 5_000


@dataclass
class Counts:
    """Rows of the partitions read, by what their run would do with them."""

    rows: float = 0
    done: float = 0  # already ok in the partition with the same request: skipped
    shared: float = 0  # the same request as an earlier row of the run: sent once
    reused: float = 0  # an answer stored before the run (or by an earlier partition's run)
    unsendable: float = 0  # the prompt did not render within its limits: fails, not sent
    requests: float = 0  # sent
    prompt_tokens: float = 0  # of the requests sent

    def add(self, other: Counts, scale: float = 1.0) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name) * scale)


class _Unsent:
    """The transport of the estimate's engine, which only builds request bodies: nothing is
    ever sent to the provider."""

    async def chat(self, body: dict[str, Any], timeout: float) -> Any:
        raise RuntimeError("the cost estimate sends no request")

    async def aclose(self) -> None:
        return None


class PartitionScanner:
    """Reads the partitions of one asset, one after the other, on one warehouse session."""

    def __init__(
        self,
        spec: LlmBatchSpec,
        run_spec: RunSpec,
        pdef: dg.PartitionsDefinition | None,
        llm: LLMResource,
        session: WarehouseSession,
        *,
        reuse: bool,
        stored: bool,
        sample_rows: int = SAMPLE_ROWS,
    ) -> None:
        """`reuse`: the asset reuses answers across partitions. `stored`: the output table
        exists (else there is nothing to skip or reuse, and nothing is asked of it)."""
        self.spec = spec
        self.run_spec = run_spec
        self.pdef = pdef
        self.llm = llm
        self.db = session
        self.reuse = reuse
        self.stored = stored
        self.sample_rows = sample_rows
        self.settings = llm.engine_settings(model=run_spec.model, params=run_spec.params)
        self.model = self.settings.model
        self.max_prompt_chars = run_spec.prompt.max_chars_for(self.settings.context_window)
        self.earlier: set[str] = set()  # identities counted in earlier partitions (reuse)
        self.engine = Engine(self.settings, _Unsent())  # builds the exact bodies; sends nothing
        self.rows_read = 0
        self.partitions_cut = 0  # partitions of which only the first rows were read

    async def scan(self, key: str | None) -> Counts:
        """One partition: its rows by outcome, scaled up to the whole partition when only its
        first rows were read."""
        where, pk, run_spec = partition_source(self.pdef, key, self.run_spec, self.spec)
        self.db.check_source(run_spec.source)
        total, _dups, _null_ids = self.db.slice_stats(run_spec.source, where)
        stats = RunStats()
        reader = SliceReader(run_spec, self.llm, self.db, where, pk, stats, self.max_prompt_chars)
        reader.nothing_done = not self.stored or not self.db.has_output(run_spec.output.name, pk)
        lookup = None
        if self.stored and (self.reuse or not reader.nothing_done):
            lookup = stored_answers(self.db, run_spec.output, pk, self.reuse)
        counts = Counts()
        seen: dict[str, bool] = {}  # identity -> its answer was stored before the run
        try:
            async with contextlib.aclosing(reader.chunks(self.engine)) as chunks:
                async for chunk in chunks:
                    await self._chunk(chunk, reader.hashes, seen, lookup, counts)
                    if counts.rows + stats.skipped >= self.sample_rows:
                        break
        finally:
            reader.stop()
        counts.done = stats.skipped
        counts.rows += stats.skipped
        self.rows_read += int(counts.rows)
        self.partitions_cut += counts.rows < total
        if self.reuse:
            self.earlier.update(seen)
        scaled = Counts()
        scaled.add(counts, total / counts.rows if counts.rows else 0.0)
        scaled.rows = total
        return scaled

    async def _chunk(
        self,
        chunk: list[ChatRequest],
        hashes: dict[Any, str],
        seen: dict[str, bool],
        lookup: Lookup | None,
        counts: Counts,
    ) -> None:
        fresh: dict[str, list[dict[str, Any]]] = {}  # identity -> the messages to send
        repeats: Counter[str] = Counter()  # identity -> later rows of this chunk with it
        for req in chunk:
            counts.rows += 1
            h = hashes.pop(req.id, None) if req.error is None else None
            if h is None or req.messages is None:
                counts.unsendable += 1
            elif h in seen:
                counts.reused += seen[h]
                counts.shared += not seen[h]
            elif h in fresh:
                repeats[h] += 1
            elif h in self.earlier:
                seen[h] = True
                counts.reused += 1
            else:
                fresh[h] = req.messages
        found = await lookup(list(fresh)) if lookup is not None and fresh else {}
        for h, messages in fresh.items():
            seen[h] = h in found
            if h in found:
                counts.reused += 1 + repeats[h]
                continue
            counts.shared += repeats[h]
            counts.requests += 1
            counts.prompt_tokens += count_prompt_tokens(messages, self.model)
