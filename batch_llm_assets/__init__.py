"""batch-llm-assets: run an LLM over every row of a warehouse table, inside the rate limits."""

from .assets import Prompt, SourceTable, build_llm_batch_asset
from .engine import ChatRequest, ChatResult, RedisLimiter
from .resources import DuckDBWarehouse, LLMResource

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
