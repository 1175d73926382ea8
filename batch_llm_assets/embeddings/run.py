"""One embedding partition run: the chat asset's partition run (assets/pipeline.py: the lease,
the journal, the reader, identical rows sent once and stored vectors reused, the writer, the
metadata) with rows packed into embedding requests instead of one chat request each.

What differs is small: the reader renders the text and hashes text + model + dimensions (the
request identity, engine/identity.py's scope); the engine the run holds is an EmbeddingSender
(packing.py, sender.py) over the real one; a result becomes a row of the embedding table.
"""

from __future__ import annotations

import asyncio
import functools
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..assets.pipeline import PartitionRun, RunSpec
from ..assets.pricing import cost_usd, price_for_resource, served_model
from ..assets.prompt import CHARS_PER_TOKEN
from ..assets.reader import SliceReader
from ..assets.writer import ChunkWriter, storable
from ..engine.budget import Cost
from ..engine.engine import Engine
from ..engine.errors import redact
from ..engine.identity import request_identity
from ..warehouses.base import OutputTable
from . import _constants as C
from .answers import EmbeddingResult
from .packing import EmbedItem, PackLimits
from .sender import EmbeddingSender

# The embedding table's columns after `id`, as (name, logical type).
EMBEDDING_COLUMNS: tuple[tuple[str, str], ...] = (
    ("partition_key", "string"),
    ("embedding", "list<float32>"),
    ("dimensions", "int"),
    ("status", "string"),
    ("error_class", "string"),
    ("error", "string"),
    ("model", "string"),
    ("prompt_tokens", "int"),
    ("completion_tokens", "int"),
    ("cost_usd", "float"),
    ("truncated", "bool"),
    ("latency_ms", "float"),
    ("total_ms", "float"),
    ("attempts", "int"),
    ("request_hash", "string"),
    ("completed_at", "timestamp"),
    ("shared_from", "string"),
)
DESCRIPTIONS = {
    "embedding": "the row's vector (NULL, or [] in BigQuery, for a failed row)",
    "dimensions": "the vector's length",
    "prompt_tokens": "the request's usage shared among its rows by their own token counts",
    "completion_tokens": "0: embeddings bill input tokens only",
    "truncated": "the text was cut to the model's input limit (truncate: true)",
    "request_hash": "sha256 of the text, model and dimensions (and the input limit when "
    "truncating) in the endpoint's scope: a rerun, or another partition, reuses a stored ok "
    "vector of the same hash instead of sending it again",
    "shared_from": "set when the row took the vector of an identical text (same request_hash) "
    "instead of sending it: that row's id, prefixed by '<partition_key>/' when in another "
    "partition",
}


def embedding_table(name: str) -> OutputTable:
    return OutputTable(name=name, columns=EMBEDDING_COLUMNS)


@dataclass(frozen=True)
class EmbeddingRunSpec(RunSpec):
    """The chat RunSpec (prompt: the text template; params: none) and the embedding's own."""

    dimensions: int | None = None
    encoding_format: str | None = None  # None: base64 where the provider takes it, else float
    truncate: bool = False
    max_inputs: int = C.MAX_INPUTS_PER_REQUEST
    max_request_tokens: int = C.MAX_TOKENS_PER_REQUEST
    max_input_tokens: int | None = None


class EmbeddingReader(SliceReader):
    """The slice's rows as EmbedItems (text rendered, identity in `hashes`), done rows skipped."""

    spec: EmbeddingRunSpec
    _identity: dict[str, Any]

    async def chunks(self, engine: Any) -> Any:
        sender: EmbeddingSender = engine
        spec = self.spec
        self._identity = {"model": sender.model}
        if spec.dimensions is not None:
            self._identity["dimensions"] = spec.dimensions
        if spec.truncate:  # a truncated text is its first max_input_tokens tokens
            self._identity["truncate_tokens"] = sender.limits.max_input_tokens
        async for chunk in super().chunks(engine):
            yield chunk

    def _unsent(self, rid: Any, error: tuple[str, str]) -> EmbedItem:
        return EmbedItem(rid, None, error=error)

    def _request(
        self, rid: Any, messages: list[dict[str, Any]], done: dict[Any, str]
    ) -> EmbedItem | None:
        """The row's text to embed, or None when it is done under the same identity."""
        text = messages[-1]["content"]
        h = request_identity({**self._identity, "input": text}, self.scopes[0])
        if done.get(rid) == h:
            self.stats.skipped += 1
            return None
        self.hashes[rid] = h
        return EmbedItem(rid, text)


class EmbeddingPartitionRun(PartitionRun):
    """Runs one partition of an embedding asset (see the module)."""

    spec: EmbeddingRunSpec

    def __init__(self, spec: EmbeddingRunSpec, llm: Any, session: Any, *args: Any, **kw: Any):
        # Vectors are large: the writer takes a chunk at a time (2 chunks pending at most).
        super().__init__(spec, llm, session, *args, max_write_rows=spec.chunk_rows, **kw)
        self.reuse = spec.reuse_answers is not False  # the same text gives the same vector
        chars = None if spec.truncate else self.max_prompt_chars  # truncate: cut, not refused
        self.reader = EmbeddingReader(
            spec, llm, session, self.where, self.partition_key, self.stats, chars
        )

    def _sender(self, engine: Engine) -> EmbeddingSender:
        spec, llm = self.spec, self.llm
        window = engine.s.context_window if not llm.profile.hosted else None
        tpm = engine.limiter.max_request_tokens if engine.limiter is not None else None
        ceiling = min(spec.max_request_tokens, tpm or spec.max_request_tokens)
        limits = PackLimits(
            max_inputs=spec.max_inputs,
            # A pack carries at most PACK_RATE_S of the tokens/min limit (see _constants.py).
            max_tokens=min(ceiling, math.ceil(tpm * C.PACK_RATE_S / 60) if tpm else ceiling),
            ceiling=ceiling,
            max_input_tokens=spec.max_input_tokens or window or C.MAX_INPUT_TOKENS,
            truncate=spec.truncate,
        )
        fmt = spec.encoding_format or (
            "base64" if llm.profile.name in C.BASE64_PROVIDERS else "float"
        )
        return EmbeddingSender(
            engine, limits=limits, dimensions=spec.dimensions, encoding_format=fmt
        )

    async def _consume(
        self,
        engine: Any,
        writer: ChunkWriter,
        started: float,
        failed: asyncio.Future[BaseException],
    ) -> None:
        sender = self._sender(engine)
        sender.room = writer.room
        if not self.spec.truncate and self.spec.prompt.max_prompt_chars is None:
            # Longer texts cannot fit: refused without tokenizing (prompt_too_large).
            self.reader.max_prompt_chars = CHARS_PER_TOKEN * sender.limits.max_input_tokens
        await super()._consume(sender, writer, started, failed)

    def _priced(self) -> Cost | None:
        """Priced at the embedding model's list price (also on a stand-in for a chat model);
        the cost of a request, for the spend caps."""
        self.price = price_for_resource(self.llm, self.model, logger=self.log, as_itself=True)
        self.stats.cost_usd = 0.0 if self.price is not None else None
        self.served_model = self.llm.served_name(self.model)
        return functools.partial(cost_usd, self.price) if self.price is not None else None

    def _row(self, r: EmbeddingResult, now: datetime) -> dict[str, Any]:  # type: ignore[override]
        cost = cost_usd(self.price, r.prompt_tokens, r.completion_tokens)
        self.stats.add(r, cost)
        self.served_model = served_model(self.model, r.model, self.served_model, self.log)
        rhash = self.reader.hashes.pop(r.id, None)
        return embedding_row(r, self.partition_key, self.model, cost, rhash, now, self.llm.api_key)


def embedding_row(
    r: EmbeddingResult,
    partition_key: str,
    model: str,
    cost: float | None,
    request_hash: str | None,
    now: datetime,
    secret: str,
) -> dict[str, Any]:
    """A result as a row of the embedding table (its vector still a float32 array)."""
    vec = r.embedding
    error = r.error_message
    return {
        "id": r.id,
        "partition_key": partition_key,
        "embedding": vec,
        "dimensions": len(vec) if vec is not None else None,
        "status": r.status,
        "error_class": r.error_class,
        "error": storable(redact(error, secret)) if error else None,
        "model": storable(r.model or model),
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cost_usd": cost,
        "truncated": r.truncated,
        "latency_ms": r.latency_ms,
        "total_ms": r.total_ms,
        "attempts": r.attempts,
        "request_hash": request_hash,
        "completed_at": now,
    }
