"""batch-llm-assets: run an LLM over every row of a warehouse table, inside the rate limits."""

from .assets import (
    LlmBatchConfigError,
    LlmBatchSpec,
    Prompt,
    SourceTable,
    build_estimate_job,
    build_llm_batch_asset,
    estimate_cost,
    select_partitions,
    source_table_spec,
)
from .embeddings import build_llm_embedding_asset
from .engine import ChatRequest, ChatResult, RedisLimiter
from .resources import DuckDBWarehouse, LLMResource

__all__ = [
    "ChatRequest",
    "ChatResult",
    "DuckDBWarehouse",
    "LLMResource",
    "LlmBatchConfigError",
    "LlmBatchSpec",
    "Prompt",
    "RedisLimiter",
    "SourceTable",
    "build_estimate_job",
    "build_llm_batch_asset",
    "build_llm_embedding_asset",
    "estimate_cost",
    "select_partitions",
    "source_table_spec",
]
