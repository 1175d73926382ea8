"""The engine: a plain async library (no Dagster) that sends many chat requests through a shared
Redis limiter, with retries, token estimation, transports and its own errors."""

from .cancel import cancel_and_wait
from .engine import Engine
from .errors import (
    BatchLLMError,
    LimiterAuthError,
    LimiterError,
    LimiterRefusedError,
    LimiterScriptError,
    LimiterUnavailableError,
    ProviderError,
)
from .limiter import Grant, LimiterSettings, RedisLimiter, limiter_namespace
from .requests import ChatRequest, ChatResult, EngineSettings
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
    "LimiterAuthError",
    "LimiterError",
    "LimiterRefusedError",
    "LimiterScriptError",
    "LimiterSettings",
    "LimiterUnavailableError",
    "ProviderError",
    "RedisLimiter",
    "cancel_and_wait",
    "count_prompt_tokens",
    "limiter_namespace",
]
