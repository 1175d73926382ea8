"""Worker settings (one dataclass) and the engine-level wiring built from them.

The worker imports the engine only (no Dagster): this is the small counterpart of
LLMResource.engine() for a long-running process.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from ..engine import Engine, EngineSettings, LimiterSettings, limiter_namespace
from ..engine import _constants as C
from ..engine.transport import TRANSPORTS
from . import _constants as K
from .metrics import MeteredLimiter, WorkerMetrics
from .queue import QueueNames, RedisQueue


@dataclass(slots=True)
class WorkerSettings:
    """Everything one worker process needs; the CLI fills it from flags and env vars."""

    redis_url: str
    base_url: str
    model: str
    api_key: str = field(default="", repr=False)
    api_version: str | None = None
    limiter_redis_url: str | None = None  # None: the queue's Redis
    queues: QueueNames = field(default_factory=QueueNames)
    concurrency: int = 64
    batch_size: int = 10
    poll_interval_s: float = 1.0
    visibility_timeout_s: float = 30.0
    request_timeout_s: float = 300.0
    drain_timeout_s: float = 120.0
    result_ttl_s: int = 86_400
    max_attempts: int = 1
    max_deliveries: int = K.DEFAULT_MAX_DELIVERIES
    breaker_cooldown_s: float = K.DEFAULT_BREAKER_COOLDOWN_S
    retry_initial_s: float = 1.0
    retry_max_s: float = 60.0
    rpm: int | None = None
    tpm: int | None = None
    burst_s: float = C.DEFAULT_BURST_S
    job_key: str = "worker"
    job_weight: float = 1.0
    default_max_tokens: int = C.DEFAULT_MAX_TOKENS
    context_window: int | None = None
    http_client: str = "aiohttp"
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = 9090  # None: no metrics server
    pool_name: str = "default"

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("redis URL must start with redis://, rediss:// or unix://")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must start with http:// or https://, got {self.base_url!r}")
        if self.http_client not in TRANSPORTS:
            raise ValueError(f"http client must be one of {sorted(TRANSPORTS)}")
        for name in ("concurrency", "batch_size", "max_attempts", "result_ttl_s", "max_deliveries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        positive = (
            "poll_interval_s",
            "visibility_timeout_s",
            "request_timeout_s",
            "job_weight",
            "breaker_cooldown_s",
        )
        for name in positive:
            if not 0 < getattr(self, name) < math.inf:  # NaN too
                raise ValueError(f"{name} must be a finite number > 0")
        if self.visibility_timeout_s < 1:
            raise ValueError("visibility timeout must be at least 1 s")

    @property
    def limited(self) -> bool:
        return bool(self.rpm or self.tpm)

    def engine_settings(self) -> EngineSettings:
        return EngineSettings(
            model=self.model,
            max_concurrency=self.concurrency,
            request_timeout_s=self.request_timeout_s,
            max_attempts=self.max_attempts,
            default_max_tokens=self.default_max_tokens,
            context_window=self.context_window or C.context_window_for(self.model),
            # A long-running worker must not stop serving after a few bad answers: its own
            # breaker (breaker.py) holds what shares a cause, and closes again.
            fatal_error_threshold=2**31,
            breaker_threshold=2**31,
            secret=self.api_key,
        )


@dataclass(slots=True)
class WorkerParts:
    engine: Engine
    queue: RedisQueue
    metrics: WorkerMetrics


@contextlib.asynccontextmanager
async def open_parts(settings: WorkerSettings) -> AsyncIterator[WorkerParts]:
    """Engine (transport + metered limiter as a fair-share job), queue and metrics; closed on exit."""
    settings.validate()
    metrics = WorkerMetrics(
        queue_name=settings.queues.request_sortedset, pool_name=settings.pool_name
    )
    client = aioredis.Redis.from_url(
        settings.redis_url, socket_timeout=10, socket_connect_timeout=5
    )
    limiter_client = client
    if settings.limiter_redis_url and settings.limiter_redis_url != settings.redis_url:
        limiter_client = aioredis.Redis.from_url(
            settings.limiter_redis_url, socket_timeout=5, socket_connect_timeout=5
        )
    limiter = None
    if settings.limited:
        limiter = MeteredLimiter(
            limiter_client,
            namespace=limiter_namespace(settings.base_url, settings.model, settings.api_key),
            settings=LimiterSettings(rpm=settings.rpm, tpm=settings.tpm, burst_s=settings.burst_s),
            job=settings.job_key,
            weight=settings.job_weight,
        )
        limiter.metrics = metrics
    transport = TRANSPORTS[settings.http_client](
        base_url=settings.base_url,
        api_key=settings.api_key,
        api_version=settings.api_version,
        model=settings.model,
        max_connections=settings.concurrency,
    )
    queue = RedisQueue(
        client,
        settings.queues,
        visibility_ms=int(settings.visibility_timeout_s * 1000),
        result_ttl_s=settings.result_ttl_s,
    )
    engine = Engine(settings.engine_settings(), transport, limiter)
    try:
        yield WorkerParts(engine, queue, metrics)
    finally:
        await engine.drain()
        if limiter is not None:
            await limiter.release()
        await transport.aclose()
        if limiter_client is not client:
            await limiter_client.aclose()
        await client.aclose()
