"""batch-llm-assets: run an LLM over every row of a warehouse table, inside the rate limits."""

from .assets import Prompt, SourceTable, build_llm_batch_asset
from .resources import ChatRequest, ChatResult, LLMResource, RedisLimiter
from .resources.duckdb_warehouse import DuckDBWarehouse

__all__ = [
    "ChatRequest",
    "ChatResult",
    "DuckDBWarehouse",
    "LLMResource",
    "Prompt",
    "RedisLimiter",
    "SourceTable",
    "build_llm_batch_asset",
]
