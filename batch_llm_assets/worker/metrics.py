"""Prometheus metrics of the worker: llm-d's names where they mean the same, plus the limiter's.

llm-d's series (`llm_d_async_async_*`) carry its queue_id / queue_name / pool_name labels, so
its Grafana dashboard and alerts work unchanged; ours are `batch_llm_worker_*`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

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
    """One registry per worker (several workers can live in one test process); `queue()` gives
    one request queue's series, labelled with its queue_id and queue_name."""

    def __init__(self, *, pool_name: str = "default") -> None:
        self.registry = CollectorRegistry()
        self.pool_name = pool_name
        self._families: dict[str, Any] = {}
        self._llm_d_series()
        self._our_series()
        self._limiter_series()
        self._delivery_series()
        self.pool_worker_limit = Gauge(
            "async_pool_worker_limit",
            "Configured concurrency of this worker.",
            ("pool_name",),
            subsystem=_LLMD,
            registry=self.registry,
        ).labels(pool_name)

    def queue(self, queue_id: str, queue_name: str) -> QueueMetrics:
        return QueueMetrics(self._families, (queue_id, queue_name, self.pool_name))

    def _counter(self, attr: str, prefix: str, name: str, doc: str) -> None:
        self._families[attr] = Counter(name, doc, _QUEUE, subsystem=prefix, registry=self.registry)

    def _gauge(self, attr: str, prefix: str, name: str, doc: str) -> None:
        self._families[attr] = Gauge(name, doc, _QUEUE, subsystem=prefix, registry=self.registry)

    def _histogram(self, attr: str, prefix: str, name: str, doc: str, buckets) -> None:
        self._families[attr] = Histogram(
            name, doc, _QUEUE, subsystem=prefix, buckets=buckets, registry=self.registry
        )

    def _llm_d_series(self) -> None:
        """llm-d's names and labels, so its dashboards and alerts work unchanged."""
        c, g = self._counter, self._gauge
        c("requests", _LLMD, "async_request", "New async requests (first attempt only).")
        c("retries", _LLMD, "async_request_retries", "Retry attempts.")
        c("successful", _LLMD, "async_successful_requests", "Requests answered successfully.")
        c(
            "failed",
            _LLMD,
            "async_failed_requests",
            "Requests failed with a non-retryable error.",
        )
        c(
            "exceeded_deadline",
            _LLMD,
            "async_exceeded_deadline_requests",
            "Requests past their deadline, not sent.",
        )
        c("shedded", _LLMD, "async_shedded_requests", "HTTP 429 answers from the provider.")
        self._histogram(
            "inference_latency",
            _LLMD,
            "async_inference_latency_time_millis",
            "Time spent calling the provider, in milliseconds (limiter wait excluded).",
            _LATENCY_MS,
        )
        g("queue_depth", _LLMD, "async_queue_depth", "Messages claimed, awaiting dispatch.")
        g("inflight", _LLMD, "async_inflight_requests", "Requests being processed.")
        g(
            "backlog",
            _LLMD,
            "async_broker_backlog",
            "Messages waiting in the request sorted set and list.",
        )

    def _our_series(self) -> None:
        """What llm-d has no series for: the engine's view."""
        c, g = self._counter, self._gauge
        c(
            "dispatched",
            _OURS,
            "dispatched_requests",
            "Messages handed to the engine (each attempt).",
        )
        self._families["tokens"] = Counter(
            "tokens",
            "Tokens the provider counted, by direction.",
            (*_QUEUE, "direction"),
            subsystem=_OURS,
            registry=self.registry,
        )
        c("invalid", _OURS, "invalid_messages", "Malformed messages answered INVALID_REQUEST.")
        c(
            "reclaimed",
            _OURS,
            "reclaimed_messages",
            "Messages whose visibility expired (a worker died).",
        )
        c(
            "cancelled",
            _OURS,
            "cancelled_messages",
            "Messages cancelled by their producer, not sent.",
        )
        c(
            "duplicates",
            _OURS,
            "duplicate_messages",
            "Deliveries of an id whose result was already written.",
        )
        g("retry_backlog", _OURS, "retry_backlog", "Messages waiting in the retry set.")
        g(
            "processing",
            _OURS,
            "processing_messages",
            "Messages in the processing set (all workers).",
        )
        g(
            "oldest_age",
            _OURS,
            "oldest_message_age_seconds",
            "Age (now - created) of the next message in line, 0 when none or no created.",
        )

    def _limiter_series(self) -> None:
        """The shared limiter's view of this queue's engine."""
        c, g = self._counter, self._gauge
        c(
            "grants",
            _OURS,
            "limiter_grants",
            "Requests granted by the shared limiter (rate = granted rate).",
        )
        c("granted_tokens", _OURS, "limiter_granted_tokens", "Tokens reserved by granted requests.")
        self._histogram(
            "limiter_wait",
            _OURS,
            "limiter_wait_seconds",
            "Wait the limiter scheduled before a send.",
            _WAIT_S,
        )
        c("http_429", _OURS, "http_429", "HTTP 429 answers from the provider.")
        g(
            "slowdown",
            _OURS,
            "limiter_slowdown_factor",
            "Adaptive slow-down in force (1 = full rate).",
        )
        g("share", _OURS, "limiter_share", "This job's fair share of the limit (0-1).")

    def _delivery_series(self) -> None:
        """Every message ends with one result (issue 27): what it took."""
        c = self._counter
        c(
            "dead_lettered",
            _OURS,
            "dead_lettered_messages",
            "Messages answered with an error and moved to their queue's dead-letter list after "
            "max_deliveries failed deliveries.",
        )
        c(
            "failed_deliveries",
            _OURS,
            "failed_deliveries",
            "Deliveries whose handling raised (the message is delivered again or dead-lettered).",
        )
        c(
            "breaker_held",
            _OURS,
            "breaker_held_messages",
            "Messages held, not sent, while a breaker was open.",
        )
        self._gauge(
            "breaker_open",
            _OURS,
            "breaker_open_scopes",
            "Breaker scopes open now in this worker (its queues' endpoints, producers).",
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class QueueMetrics:
    """One request queue's series (the families' children for its labels)."""

    def __init__(self, families: dict[str, Any], labels: tuple[str, str, str]) -> None:
        for attr, family in families.items():
            if attr != "tokens":
                setattr(self, attr, family.labels(*labels))
        self.input_tokens = families["tokens"].labels(*labels, "input")
        self.output_tokens = families["tokens"].labels(*labels, "output")
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

    def record_grant(self, grant: Grant) -> None:
        if grant.granted:
            self.grants.inc()
            self.granted_tokens.inc(grant.tokens)
            self.limiter_wait.observe(grant.wait_s)
        self.slowdown.set(grant.factor)
        self.share.set(grant.share)


class MeteredLimiter(RedisLimiter):
    """The engine's limiter, reporting each grant and slow-down to the worker's metrics."""

    metrics: QueueMetrics | None = None

    async def acquire(self, tokens: int | Callable[[], int], **kwargs) -> Grant:
        grant = await super().acquire(tokens, **kwargs)
        if self.metrics is not None:
            self.metrics.record_grant(grant)
        return grant

    async def penalize(self, grant: Grant, *, retry_after_s: float | None) -> None:
        await super().penalize(grant, retry_after_s=retry_after_s)
        if self.metrics is not None:
            self.metrics.slowdown.set(self.factor)


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
