"""batch-llm-assets: run an LLM over every row of a warehouse table, inside the rate limits."""

from .resources import ChatRequest, ChatResult, LLMResource, RedisLimiter

__all__ = ["ChatRequest", "ChatResult", "LLMResource", "RedisLimiter"]
