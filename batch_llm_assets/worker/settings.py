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
from .metrics import MeteredLimiter, QueueMetrics, WorkerMetrics
from .queue import QueueNames, RedisQueue
from .request_queues import (
    MERGE_POLICIES,
    RequestQueue,
    check_base_url,
    check_job_key,
    validate_queues,
)

OBJECTIVE_HEADER = "x-gateway-inference-objective"  # llm-d's, read by the inference gateway


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
    # Several request queues (request_queues.py); empty: the one of `queues`, as before.
    request_queues: tuple[RequestQueue, ...] = ()
    merge_policy: str = "random-robin"
    inference_objective: str = ""  # of the single queue; each of request_queues has its own
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
        if not all(q.base_url for q in self.served()):  # some queue goes to the worker's
            check_base_url(self.base_url, "the base URL (--redis.ss.igw-base-url)")
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
        if self.merge_policy not in MERGE_POLICIES:
            raise ValueError(
                f"request merge policy must be one of {MERGE_POLICIES}, got {self.merge_policy!r}"
            )
        check_job_key(self.job_key, "job key (--job-key)")
        if self.request_queues:
            validate_queues(self.request_queues, self.queues)
        else:
            self.served()[0].validate()

    def served(self) -> tuple[RequestQueue, ...]:
        """The request queues: request_queues, or the single one of the flags."""
        if self.request_queues:
            return tuple(self.request_queues)
        single = RequestQueue(
            name=self.queues.request_sortedset, inference_objective=self.inference_objective
        )
        return (single,)

    def names_of(self, q: RequestQueue) -> QueueNames:
        return q.names(self.queues) if self.request_queues else self.queues

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


@dataclass(slots=True, eq=False)
class Lane:
    """One request queue served: its keys, its engine (its gateway, its objective header, its
    limiter job) and its metrics."""

    spec: RequestQueue
    queue: RedisQueue
    engine: Engine
    metrics: QueueMetrics

    async def heads(self, n: int) -> list[float]:
        """The deadlines of its next n messages (merge.py's deadline-first)."""
        reclaimed, deadlines = await self.queue.heads(n)
        if reclaimed:
            self.metrics.reclaimed.inc(reclaimed)
        return deadlines

    @property
    def scope(self) -> str:
        """Its breaker scope for failures of its gateway (breaker.py)."""
        return f"endpoint of queue {self.spec.name}"


@dataclass(slots=True)
class WorkerParts:
    lanes: list[Lane]
    metrics: WorkerMetrics


def _engine(settings: WorkerSettings, q: RequestQueue, limiter_client, metrics) -> Engine:
    """The queue's engine: its gateway and objective header; as a limiter job, its own when it
    names one (weighted by its weight), else the worker's."""
    base_url = q.base_url or settings.base_url
    limiter = None
    if settings.limited:
        limiter = MeteredLimiter(
            limiter_client,
            namespace=limiter_namespace(base_url, settings.model, settings.api_key),
            settings=LimiterSettings(rpm=settings.rpm, tpm=settings.tpm, burst_s=settings.burst_s),
            job=q.job_key or settings.job_key,
            weight=q.weight if q.job_key else settings.job_weight,
        )
        limiter.metrics = metrics
    transport = TRANSPORTS[settings.http_client](
        base_url=base_url,
        api_key=settings.api_key,
        api_version=settings.api_version,
        model=settings.model,
        max_connections=settings.concurrency,
        extra_headers={OBJECTIVE_HEADER: q.inference_objective} if q.inference_objective else None,
    )
    return Engine(settings.engine_settings(), transport, limiter)


async def _close(engine: Engine) -> None:
    await engine.drain()
    if engine.limiter is not None:
        await engine.limiter.release()
    await engine.transport.aclose()


@contextlib.asynccontextmanager
async def open_parts(settings: WorkerSettings) -> AsyncIterator[WorkerParts]:
    """Per request queue an engine (transport + metered limiter as a fair-share job), its queue
    and metrics; closed on exit."""
    settings.validate()
    metrics = WorkerMetrics(pool_name=settings.pool_name)
    client = aioredis.Redis.from_url(
        settings.redis_url, socket_timeout=10, socket_connect_timeout=5
    )
    limiter_client = client
    if settings.limiter_redis_url and settings.limiter_redis_url != settings.redis_url:
        limiter_client = aioredis.Redis.from_url(
            settings.limiter_redis_url, socket_timeout=5, socket_connect_timeout=5
        )
    lanes = []
    for q in settings.served():
        m = metrics.queue(q.queue_id, q.name)
        queue = RedisQueue(
            client,
            settings.names_of(q),
            visibility_ms=int(settings.visibility_timeout_s * 1000),
            result_ttl_s=settings.result_ttl_s,
        )
        lanes.append(Lane(q, queue, _engine(settings, q, limiter_client, m), m))
    try:
        yield WorkerParts(lanes, metrics)
    finally:
        for lane in lanes:
            await _close(lane.engine)
        if limiter_client is not client:
            await limiter_client.aclose()
        await client.aclose()
