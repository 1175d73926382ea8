"""Batch mode for embeddings: a partition's pending rows through the provider's Batch API as
/v1/embeddings lines, at the batch price, exactly once across a crash.

It is the chat batch mode (assets/batch_mode.py: the state table, the intent recorded before the
batch is created, adoption of an orphan batch, resubmission of unreached rows, the lease) with
other lines: one row per line (`input` its text), so a line's custom_id names one row as in chat
mode, and a file of at most 50,000 lines stays within OpenAI's 50,000 embedding inputs per batch
(_constants.py). A line's request_hash is the live mode's (text, model, dimensions): a row done
live is skipped in batch mode and the other way round.

Prices: genai-prices lists the live price for embedding models under batch processing too
(text-embedding-3-small: 0.02 USD per 1M tokens both ways, offline, genai-prices 0.2.3), while
OpenAI bills batches at half: the live list price times `price_factor` (0.5) is used.
"""

from __future__ import annotations

import dataclasses
import functools
from datetime import UTC, datetime
from typing import Any

from ..assets.batch_budget import BatchBudget
from ..assets.batch_mode import BatchPartitionRun
from ..assets.batch_pending import PendingLines
from ..assets.batch_results import BatchRows, custom_id
from ..assets.pricing import cost_usd, price_for_resource
from ..assets.template_breaker import TemplateBreaker
from ..engine import errors as E
from ..engine.batch_api import ENDPOINT_TAG, BatchLine, LineResult
from ..engine.identity import request_identity
from . import _constants as C
from .answers import EmbeddingResult, decode
from .packing import EmbedItem, PackLimits, sized
from .run import EmbeddingRunSpec, embedding_row

ENDPOINT = "/v1/embeddings"


class EmbeddingBatchRows(BatchRows):
    """Batch lines as rows of the embedding table, priced at the batch price."""

    def __init__(self, llm: Any, model: str, partition_key: str, factor: float, dims: int | None):
        super().__init__(llm, model, partition_key, factor)
        live = price_for_resource(llm, model, as_itself=True)
        self.price = (
            None
            if live is None
            else dataclasses.replace(
                live,
                input_per_1m=live.input_per_1m * factor,
                output_per_1m=live.output_per_1m * factor,
                cached_input_per_1m=live.cached_input_per_1m * factor,
                batch=True,
            )
        )
        self.stats.cost_usd = 0.0 if self.price is not None else None
        self.parse_body = functools.partial(_one_vector, dims=dims)
        self.secret = getattr(llm, "api_key", "")

    def line(self, rid: Any, rhash: str, line: LineResult, **_: Any) -> dict[str, Any]:
        answer = line.response
        if answer is None:
            return self.failed(
                rid, rhash, line.error_class or E.SERVER_ERROR, line.error_message or "", attempts=1
            )
        tokens = answer.usage.prompt_tokens if answer.usage is not None else None
        result = EmbeddingResult(
            rid,
            "ok",
            prompt_tokens=tokens,
            completion_tokens=0,
            attempts=1,
            model=answer.model,
            embedding=answer.vectors[0],
        )
        return self.row(result, rhash)

    def row(self, r: Any, rhash: str | None) -> dict[str, Any]:
        cost = cost_usd(self.price, r.prompt_tokens, r.completion_tokens)
        self.stats.add(r, cost)
        return embedding_row(
            r, self.partition_key, self.model, cost, rhash, datetime.now(UTC), self.secret
        )


def _one_vector(body: Any, headers: dict[str, str], *, dims: int | None) -> Any:
    return decode(body, headers, 1, dims)


class EmbeddingPendingLines(PendingLines):
    """The chat batch mode's pending rows (done rows skipped, identical texts sent once, stored
    vectors reused), each made into an embeddings line."""

    spec: EmbeddingRunSpec

    def __init__(self, spec: EmbeddingRunSpec, llm: Any, *args: Any, **kw: Any) -> None:
        super().__init__(spec, llm, *args, **kw)
        self.max_tokens = 0  # an embedding has no answer budget
        self.reuse = spec.reuse_answers is not False  # the same text gives the same vector
        limit = spec.max_input_tokens or C.MAX_INPUT_TOKENS
        self.limits = PackLimits(
            max_inputs=1,
            max_tokens=spec.max_request_tokens,
            max_input_tokens=limit,
            truncate=spec.truncate,
            ceiling=spec.max_request_tokens,
        )
        if spec.truncate:
            self.max_prompt_chars = None  # cut, not refused
        self.identity: dict[str, Any] = {"model": self.model}  # as the live reader's (run.py)
        if spec.dimensions is not None:
            self.identity["dimensions"] = spec.dimensions
        if spec.truncate:
            self.identity["truncate_tokens"] = limit
        self.body: dict[str, Any] = {"model": self.model, "encoding_format": "base64"}
        if spec.encoding_format == "float" or llm.profile.name not in C.BASE64_PROVIDERS:
            self.body["encoding_format"] = "float"
        if spec.dimensions is not None:
            self.body["dimensions"] = spec.dimensions

    def _line(
        self,
        row: dict[str, Any],
        done: dict[Any, str],
        in_flight: set[str],
        failed: list[dict[str, Any]],
        breaker: TemplateBreaker,
    ) -> BatchLine | None:
        """The row's line; None when it is done, in an open batch, or failed unsent (then its
        row is in `failed`)."""
        rendered = self._rendered(row, failed, breaker)
        if rendered is None:
            return None
        rid, messages = rendered
        text = messages[-1]["content"]
        rhash = request_identity({**self.identity, "input": text}, self.scopes[0])
        cid = custom_id(rid, rhash)
        if done.get(rid) == rhash:
            self.stats.skipped += 1
            self.finalized.add(rid)
            return None
        if cid in in_flight:
            return None
        item = sized(EmbedItem(rid, text), self.limits, self.model)
        if item.error is not None:
            self.finalized.add(rid)
            failed.append(self.rows.failed(rid, rhash, *item.error))
            return None
        self.items[cid] = (rid, rhash)
        return BatchLine(cid, {**self.body, "input": item.text}, item.tokens, url=ENDPOINT)


class EmbeddingBatchRun(BatchPartitionRun):
    """One partition of an embedding asset in batch mode (see the module)."""

    spec: EmbeddingRunSpec

    def __init__(
        self, spec: EmbeddingRunSpec, llm: Any, session: Any, where: Any, *a: Any, **kw: Any
    ):
        super().__init__(spec, llm, session, where, *a, **kw)
        self.rows = EmbeddingBatchRows(
            llm, self.model, self.partition_key, self.s.price_factor, spec.dimensions
        )
        self.lines = EmbeddingPendingLines(
            spec,
            llm,
            session,
            where,
            partition_key=self.partition_key,
            state_table=self.state_table,
            asset=self.asset,
            rows=self.rows,
        )
        self.max_tokens = 0
        self.stats = self.rows.stats
        self.finalized = self.lines.finalized
        self.price = self.rows.price
        self.budget = BatchBudget(self)  # priced at the embedding batch price

    def _metadata(self, record: dict[str, Any]) -> dict[str, str]:
        return {**super()._metadata(record), ENDPOINT_TAG: ENDPOINT}
