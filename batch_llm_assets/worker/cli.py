"""`batch-llm-assets worker`: flags and environment variables, named like llm-d's where they
mean the same (--redis.url / REDIS_URL, --redis.ss.request-queue-name, --concurrency, ...)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal

from .metrics import start_metrics_server
from .queue import QueueNames
from .request_queues import RequestQueue, parse_request_queues
from .settings import WorkerSettings, open_parts
from .worker import Worker

log = logging.getLogger(__name__)

_ENV_PREFIX = "BATCH_LLM_WORKER_"
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration(text: str) -> float:
    """Seconds from a Go-style duration (300ms, 30s, 5m, 1h, 1m30s) or a plain number."""
    text = str(text).strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30s, 5m, 1h)")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def _optional_int(text: str) -> int | None:
    return int(text) if text not in ("", "0", "none", "None") else None


# (flag, settings field, env var, type, default, help). Defaults are llm-d's where it has one.
_OPTIONS = [
    ("--redis.url", "redis_url", "REDIS_URL", str, None, "Redis/Valkey URL of the queues."),
    (
        "--redis.ss.igw-base-url",
        "base_url",
        "OPENAI_BASE_URL",
        str,
        None,
        "OpenAI-compatible endpoint up to /v1 (llm-d: the inference gateway base URL).",
    ),
    ("--api-key", "api_key", "OPENAI_API_KEY", str, "", "API key (prefer the env var)."),
    ("--api-version", "api_version", None, str, None, "Azure OpenAI API version."),
    ("--model", "model", None, str, None, "Model served (payload.model must match if set)."),
    (
        "--redis.ss.request-queue-name",
        "request_sortedset",
        None,
        str,
        "request-sortedset",
        "Request sorted set (score = deadline).",
    ),
    (
        ("--redis.ss.inference-objective", "--redis.inference-objective"),
        "inference_objective",
        None,
        str,
        "",
        "Sent as the x-gateway-inference-objective header when set (the single queue's).",
    ),
    (
        ("--redis.request-queues", "--redis.ss.queues-config"),
        "request_queues",
        None,
        str,
        None,
        "Several request queues: a JSON or YAML list of {queue_name, type, igw_base_url, "
        "inference_objective, job_key, weight, dead_letter} (docs/worker.md).",
    ),
    (
        "--redis.ss.queues-config-file",
        "request_queues_file",
        None,
        str,
        None,
        "The same list from a JSON or YAML file.",
    ),
    (
        "--request-merge-policy",
        "merge_policy",
        None,
        str,
        "random-robin",
        "Which queue the next message comes from: random-robin, weighted, deadline-first.",
    ),
    (
        "--redis.request-list-name",
        "request_list",
        None,
        str,
        None,
        "Also consume this plain list (LPUSH by producers).",
    ),
    (
        "--redis.retry-queue-name",
        "retry_sortedset",
        None,
        str,
        "retry-sortedset",
        "Retry sorted set (score = when due).",
    ),
    (
        "--redis.ss.result-queue-name",
        "result_list",
        None,
        str,
        "result-list",
        "Result list (LPUSH, as llm-d).",
    ),
    (
        "--redis.result-stream-name",
        "result_stream",
        None,
        str,
        None,
        "Also XADD each result to this stream.",
    ),
    (
        "--redis.processing-set-name",
        "processing",
        None,
        str,
        None,
        "Processing set; default <request queue>:processing.",
    ),
    (
        "--redis.dead-letter-name",
        "dead_letter",
        None,
        str,
        None,
        "Dead-letter list; default <request queue>:dead-letter.",
    ),
    (
        "--redis.ss.poll-interval-ms",
        "poll_interval_ms",
        None,
        int,
        1000,
        "Idle poll interval in milliseconds.",
    ),
    ("--redis.ss.batch-size", "batch_size", None, int, 10, "Messages claimed per poll."),
    ("--concurrency", "concurrency", None, int, 64, "Messages in flight in this worker."),
    (
        "--request-timeout",
        "request_timeout_s",
        None,
        duration,
        "5m",
        "Timeout of one HTTP attempt.",
    ),
    (
        "--drain-timeout",
        "drain_timeout_s",
        None,
        duration,
        "2m",
        "On SIGTERM, time given to in-flight requests before they are handed back.",
    ),
    (
        "--visibility-timeout",
        "visibility_timeout_s",
        None,
        duration,
        "30s",
        "A claimed message returns to the queue this long after its worker stopped beating.",
    ),
    (
        "--result-dedup-ttl",
        "result_ttl_s",
        None,
        duration,
        "24h",
        "How long a written result blocks another result for the same id.",
    ),
    (
        "--max-attempts",
        "max_attempts",
        None,
        int,
        1,
        "HTTP attempts per dispatch; further retries go through the retry set.",
    ),
    (
        "--max-deliveries",
        "max_deliveries",
        None,
        int,
        3,
        "Deliveries of a message whose handling fails (or whose worker dies) before it is "
        "answered with an error and dead-lettered.",
    ),
    (
        "--breaker-cooldown",
        "breaker_cooldown_s",
        None,
        duration,
        "30s",
        "How long an open breaker scope (the endpoint, a producer) holds its messages before a "
        "probe; doubled after each failed probe, up to 10m.",
    ),
    ("--retry-initial-delay", "retry_initial_s", None, duration, "1s", "First retry backoff."),
    ("--retry-max-delay", "retry_max_s", None, duration, "1m", "Longest retry backoff."),
    (
        "--limiter-redis-url",
        "limiter_redis_url",
        None,
        str,
        None,
        "Redis of the shared limiter when not the queue's (the Dagster resource's redis_url).",
    ),
    ("--rpm", "rpm", None, _optional_int, None, "Requests/min of the key for this model."),
    ("--tpm", "tpm", None, _optional_int, None, "Tokens/min of the key for this model."),
    ("--burst", "burst_s", None, duration, "0s", "Burst allowance in seconds of the limit."),
    ("--job-key", "job_key", None, str, "worker", "Fair-share job name of this worker."),
    ("--job-weight", "job_weight", None, float, 1.0, "Weight of this job's fair share."),
    (
        "--max-tokens",
        "default_max_tokens",
        None,
        int,
        256,
        "Answer budget reserved when the payload sets no max_tokens.",
    ),
    (
        "--context-window",
        "context_window",
        None,
        _optional_int,
        None,
        "Context window of the model; default: the known models' table.",
    ),
    ("--http-client", "http_client", None, str, "aiohttp", "aiohttp (lean) or openai (the SDK)."),
    ("--metrics-port", "metrics_port", None, int, 9090, "Port of /metrics and /healthz (0: any)."),
    ("--metrics-host", "metrics_host", None, str, "0.0.0.0", "Address of the metrics server."),
    ("--pool-name", "pool_name", None, str, "default", "pool_name label of the metrics."),
]
_QUEUE_FIELDS = (
    "request_sortedset",
    "request_list",
    "retry_sortedset",
    "result_list",
    "result_stream",
    "processing",
    "dead_letter",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every option as a flag; its env var (llm-d's or BATCH_LLM_WORKER_<NAME>) is the default."""
    for flags, dest, env, kind, default, text in _OPTIONS:
        env = env or _ENV_PREFIX + dest.upper()
        value = os.environ.get(env, default)
        if isinstance(value, str) and kind is not str:
            value = kind(value)
        hint = f"env {env}" + ("" if dest == "api_key" else f"; default {default}")
        flags = flags if isinstance(flags, tuple) else (flags,)
        p.add_argument(*flags, dest=dest, type=kind, default=value, help=f"{text} ({hint})")
    p.add_argument("--log-level", default=os.environ.get(_ENV_PREFIX + "LOG_LEVEL", "INFO"))


def _flag(dest: str) -> str:
    flags = next(f for f, d, *_ in _OPTIONS if d == dest)
    return flags[0] if isinstance(flags, tuple) else flags


def _request_queues(text: str | None, path: str | None) -> tuple[RequestQueue, ...]:
    if text and path:
        raise ValueError(
            f"{_flag('request_queues')} and {_flag('request_queues_file')} are mutually exclusive"
        )
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the request queues file {path!r}: {exc}") from None
    return parse_request_queues(text) if text else ()


# What names the single queue of the flags: with --redis.request-queues, each queue has its own.
_SINGLE_QUEUE = (
    "request_sortedset",
    "request_list",
    "processing",
    "dead_letter",
    "inference_objective",
)


def _defaults_changed(values: dict, dests: tuple[str, ...]) -> list[str]:
    default = {d: default for _, d, _, _, default, _ in _OPTIONS}
    return [_flag(d) for d in dests if values[d] not in (default[d], None, "")]


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    values = {dest: getattr(args, dest) for _, dest, *_ in _OPTIONS}
    served = _request_queues(values.pop("request_queues"), values.pop("request_queues_file"))
    if served and (single := _defaults_changed(values, _SINGLE_QUEUE)):
        raise ValueError(
            f"{', '.join(single)}: a single-queue setting; with {_flag('request_queues')} "
            "set it per queue"
        )
    needed = ("redis_url", "model")
    if not served or not all(q.base_url for q in served):  # a queue goes to the worker's
        needed += ("base_url",)
    missing = [_flag(d) for d in needed if not values[d]]
    if missing:
        raise ValueError(f"missing required settings: {', '.join(missing)}")
    queues = QueueNames(**{k: values.pop(k) or None for k in _QUEUE_FIELDS})
    if not queues.request_sortedset or not queues.result_list:
        raise ValueError("the request sorted set and result list names must not be empty")
    values["poll_interval_s"] = values.pop("poll_interval_ms") / 1000
    values["result_ttl_s"] = max(1, int(values["result_ttl_s"]))
    return WorkerSettings(queues=queues, request_queues=served, **values)


async def serve(settings: WorkerSettings, stop: asyncio.Event | None = None) -> None:
    """Run a worker until SIGTERM/SIGINT (or `stop`), with its metrics server."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with open_parts(settings) as parts:
        worker = Worker(settings, parts)
        runner = None
        if settings.metrics_port is not None:
            runner, port = await start_metrics_server(
                parts.metrics,
                settings.metrics_host,
                settings.metrics_port,
                healthy=lambda: not worker.stopping,
            )
            print(f"worker metrics on http://{settings.metrics_host}:{port}/metrics", flush=True)
        served = ", ".join(lane.spec.name for lane in parts.lanes)
        print(f"worker serving {served} ({settings.merge_policy})", flush=True)
        try:
            await worker.run(stop)
        finally:
            if runner is not None:
                await runner.cleanup()
    print("worker stopped", flush=True)


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = settings_from_args(args)
        settings.validate()
    except ValueError as exc:
        raise SystemExit(f"batch-llm-assets worker: {exc}") from None
    asyncio.run(serve(settings))
