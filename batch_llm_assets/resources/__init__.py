"""The engine: LLMResource, the Redis limiter, token estimation and transports."""

from .engine import ChatRequest, ChatResult, Engine, EngineSettings
from .errors import BatchLLMError, LimiterUnavailableError, ProviderError
from .limiter import Grant, LimiterSettings, RedisLimiter, limiter_namespace
from .llm import LLMResource
from .tokens import count_prompt_tokens
from .valkey import EmbeddedValkey

__all__ = [
    "BatchLLMError",
    "ChatRequest",
    "ChatResult",
    "EmbeddedValkey",
    "Engine",
    "EngineSettings",
    "Grant",
    "LLMResource",
    "LimiterSettings",
    "LimiterUnavailableError",
    "ProviderError",
    "RedisLimiter",
    "count_prompt_tokens",
    "limiter_namespace",
]
