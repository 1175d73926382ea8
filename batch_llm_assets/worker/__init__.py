"""An llm-d-compatible queue worker on the engine and the shared Redis limiter (no Dagster)."""

from .messages import (
    CANCELLED,
    DEADLINE_EXCEEDED,
    INFERENCE_ERROR,
    INVALID_REQUEST,
    InvalidMessage,
    RequestMessage,
    parse_message,
)
from .metrics import WorkerMetrics, start_metrics_server
from .queue import QueueNames, RedisQueue, submit
from .request_queues import QueueConfigError, RequestQueue, parse_request_queues
from .settings import WorkerSettings, open_parts
from .worker import Worker

__all__ = [
    "CANCELLED",
    "DEADLINE_EXCEEDED",
    "INFERENCE_ERROR",
    "INVALID_REQUEST",
    "InvalidMessage",
    "QueueConfigError",
    "QueueNames",
    "RedisQueue",
    "RequestMessage",
    "RequestQueue",
    "Worker",
    "WorkerMetrics",
    "WorkerSettings",
    "open_parts",
    "parse_message",
    "parse_request_queues",
    "start_metrics_server",
    "submit",
]
