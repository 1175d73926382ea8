"""Prometheus metrics of the worker: llm-d's names where they mean the same, plus the limiter's.

llm-d's series (`llm_d_async_async_*`) carry its queue_id / queue_name / pool_name labels, so
its Grafana dashboard and alerts work unchanged; ours are `batch_llm_worker_*`.
"""

from __future__ import annotations

import socket

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ..engine import ChatResult, Grant, RedisLimiter

_LLMD = "llm_d_async"
_OURS = "batch_llm_worker"
_QUEUE = ("queue_id", "queue_name", "pool_name")
_LATENCY_MS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000)
_WAIT_S = (0, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class WorkerMetrics:
    """One registry per worker (several workers can live in one test process)."""

    def __init__(self, *, queue_name: str, pool_name: str = "default") -> None:
        self.registry = r = CollectorRegistry()
        labels = (queue_name, queue_name, pool_name)

        def counter(prefix: str, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, (*_QUEUE, *extra), subsystem=prefix, registry=r)

        def gauge(prefix: str, name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _QUEUE, subsystem=prefix, registry=r).labels(*labels)

        self.requests = counter(
            _LLMD, "async_request", "New async requests (first attempt only)."
        ).labels(*labels)
        self.retries = counter(_LLMD, "async_request_retries", "Retry attempts.").labels(*labels)
        self.successful = counter(
            _LLMD, "async_successful_requests", "Requests answered successfully."
        ).labels(*labels)
        self.failed = counter(
            _LLMD, "async_failed_requests", "Requests failed with a non-retryable error."
        ).labels(*labels)
        self.exceeded_deadline = counter(
            _LLMD, "async_exceeded_deadline_requests", "Requests past their deadline, not sent."
        ).labels(*labels)
        self.shedded = counter(
            _LLMD, "async_shedded_requests", "HTTP 429 answers from the provider."
        ).labels(*labels)
        self.inference_latency = Histogram(
            "async_inference_latency_time_millis",
            "Time spent calling the provider, in milliseconds (limiter wait excluded).",
            _QUEUE,
            subsystem=_LLMD,
            buckets=_LATENCY_MS,
            registry=r,
        ).labels(*labels)
        self.queue_depth = gauge(
            _LLMD, "async_queue_depth", "Messages claimed by this worker awaiting dispatch."
        )
        self.inflight = gauge(
            _LLMD, "async_inflight_requests", "Requests being processed by this worker."
        )
        self.backlog = gauge(
            _LLMD, "async_broker_backlog", "Messages waiting in the request sorted set and list."
        )
        self.pool_worker_limit = Gauge(
            "async_pool_worker_limit",
            "Configured concurrency of this worker.",
            ("pool_name",),
            subsystem=_LLMD,
            registry=r,
        ).labels(pool_name)

        self.dispatched = counter(
            _OURS, "dispatched_requests", "Messages handed to the engine (each attempt)."
        ).labels(*labels)
        self.tokens = counter(
            _OURS, "tokens", "Tokens the provider counted, by direction.", ("direction",)
        )
        self.input_tokens = self.tokens.labels(*labels, "input")
        self.output_tokens = self.tokens.labels(*labels, "output")
        self.invalid = counter(
            _OURS, "invalid_messages", "Malformed messages answered INVALID_REQUEST."
        ).labels(*labels)
        self.reclaimed = counter(
            _OURS, "reclaimed_messages", "Messages whose visibility expired (a worker died)."
        ).labels(*labels)
        self.cancelled = counter(
            _OURS, "cancelled_messages", "Messages cancelled by their producer, not sent."
        ).labels(*labels)
        self.duplicates = counter(
            _OURS, "duplicate_messages", "Deliveries of an id whose result was already written."
        ).labels(*labels)
        self.retry_backlog = gauge(_OURS, "retry_backlog", "Messages waiting in the retry set.")
        self.processing = gauge(
            _OURS, "processing_messages", "Messages in the processing set (all workers)."
        )
        self.grants = counter(
            _OURS, "limiter_grants", "Requests granted by the shared limiter (rate = granted rate)."
        ).labels(*labels)
        self.granted_tokens = counter(
            _OURS, "limiter_granted_tokens", "Tokens reserved by granted requests."
        ).labels(*labels)
        self.limiter_wait = Histogram(
            "limiter_wait_seconds",
            "Wait the limiter scheduled before a send.",
            _QUEUE,
            subsystem=_OURS,
            buckets=_WAIT_S,
            registry=r,
        ).labels(*labels)
        self.http_429 = counter(_OURS, "http_429", "HTTP 429 answers from the provider.").labels(
            *labels
        )
        self.slowdown = gauge(
            _OURS, "limiter_slowdown_factor", "Adaptive slow-down in force (1 = full rate)."
        )
        self.share = gauge(_OURS, "limiter_share", "This job's fair share of the limit (0-1).")
        self.slowdown.set(1.0)

    def record_result(self, result: ChatResult) -> None:
        """What one engine call did: latency, tokens, 429s."""
        if result.latency_ms is not None:
            self.inference_latency.observe(result.latency_ms)
        if result.prompt_tokens:
            self.input_tokens.inc(result.prompt_tokens)
        if result.completion_tokens:
            self.output_tokens.inc(result.completion_tokens)
        if result.http_429:
            self.http_429.inc(result.http_429)
            self.shedded.inc(result.http_429)

    def record_grant(self, grant: Grant, tokens: int) -> None:
        if grant.granted:
            self.grants.inc()
            self.granted_tokens.inc(tokens)
            self.limiter_wait.observe(grant.wait_s)
        self.slowdown.set(grant.factor)
        self.share.set(grant.share)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MeteredLimiter(RedisLimiter):
    """The engine's limiter, reporting each grant and slow-down to the worker's metrics."""

    metrics: WorkerMetrics | None = None

    async def acquire(self, tokens: int, **kwargs) -> Grant:
        grant = await super().acquire(tokens, **kwargs)
        if self.metrics is not None:
            self.metrics.record_grant(grant, tokens)
        return grant

    async def penalize(self, **kwargs) -> float:
        factor = await super().penalize(**kwargs)
        if self.metrics is not None and factor:
            self.metrics.slowdown.set(factor)
        return factor


async def start_metrics_server(
    metrics: WorkerMetrics, host: str, port: int, healthy=None
) -> tuple[web.AppRunner, int]:
    """/metrics (Prometheus text) and /healthz on host:port (0 picks a free port)."""

    async def serve_metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def serve_health(request: web.Request) -> web.Response:
        ok = healthy() if healthy is not None else True
        return web.Response(status=200 if ok else 503, text="ok" if ok else "stopping")

    app = web.Application()
    app.router.add_get("/metrics", serve_metrics)
    app.router.add_get("/healthz", serve_health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    await web.SockSite(runner, sock).start()
    return runner, sock.getsockname()[1]
