"""The llm-d-compatible queue worker on real Valkey and the simulator over HTTP: round trips,
deadlines, malformed messages, retries, idempotent results, cancellation, metrics; its helpers
serve the other test_worker_* modules (the process itself: test_worker_process.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
import uuid

import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from batch_llm_assets.worker import (
    CANCELLED,
    DEADLINE_EXCEEDED,
    INVALID_REQUEST,
    QueueNames,
    Worker,
    WorkerSettings,
    open_parts,
    start_metrics_server,
    submit,
)
from batch_llm_assets.worker.queue import Held, cancel_key

from .conftest import SIM_KEY

MODEL = "gpt-4o-mini"


def names(prefix: str, **kw) -> QueueNames:
    return QueueNames(
        request_sortedset=f"{prefix}:requests",
        retry_sortedset=f"{prefix}:retry",
        result_list=f"{prefix}:results",
        **kw,
    )


def settings(sim, url: str, queues: QueueNames, **kw) -> WorkerSettings:
    base = dict(
        redis_url=url,
        base_url=sim.url,
        model=MODEL,
        api_key=SIM_KEY,
        queues=queues,
        concurrency=8,
        poll_interval_s=0.05,
        visibility_timeout_s=2.0,
        request_timeout_s=10.0,
        drain_timeout_s=5.0,
        retry_initial_s=0.2,
        retry_max_s=1.0,
        metrics_port=None,
    )
    return WorkerSettings(**(base | kw))


def message(msg_id: str, *, deadline_in: float = 60.0, text: str | None = None, **kw) -> dict:
    now = time.time()
    return {
        "id": msg_id,
        "created": int(now),
        "deadline": now + deadline_in,
        "payload": {
            "model": MODEL,
            "messages": [{"role": "user", "content": text or f"headline {msg_id}: up or down?"}],
            "max_tokens": 8,
        },
        "metadata": {"user": "test"},
        **kw,
    }


async def submit_envelope(client, msg: dict, sortedset: str) -> None:
    """A message in llm-d's persistence envelope, as its Go producer writes it."""
    member = {"internal": {"retry_count": 0}, "request_kind": "plain", "data": msg}
    await client.zadd(sortedset, {json.dumps(member): msg["deadline"]})


@pytest.fixture
def prefix():
    return f"wq{uuid.uuid4().hex[:10]}"


@contextlib.asynccontextmanager
async def running(s: WorkerSettings):
    """A worker serving in this event loop until the block ends."""
    async with open_parts(s) as parts:
        worker = Worker(s, parts)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            yield parts
        finally:
            stop.set()
            await task


async def wait_results(client, key: str, n: int, timeout: float = 20.0) -> list[dict]:
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        rows = await client.lrange(key, 0, -1)
        if len(rows) >= n:
            return [json.loads(r) for r in rows]
        await asyncio.sleep(0.05)
    raise AssertionError(f"only {await client.llen(key)} of {n} results after {timeout} s")


def sample(parts, name: str, queues: QueueNames) -> float:
    q = queues.request_sortedset
    labels = {"queue_id": q, "queue_name": q, "pool_name": "default"}
    return parts.metrics.registry.get_sample_value(name, labels) or 0.0


def by_id(results: list[dict]) -> dict[str, dict]:
    return {r["id"]: r for r in results}


def test_round_trip_from_sorted_set_and_list(fresh_sim, valkey_url, prefix):
    queues = names(prefix, request_list=f"{prefix}:list", result_stream=f"{prefix}:stream")

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        for i in range(2):
            await submit(client, message(f"z{i}"), sortedset=queues.request_sortedset)
        await submit_envelope(client, message("z2"), queues.request_sortedset)
        for i in range(2):
            await submit(client, message(f"l{i}"), list_name=queues.request_list)
        async with running(settings(fresh_sim, valkey_url, queues, rpm=6000)):
            results = await wait_results(client, queues.result_list, 5)
        stream = await client.xlen(queues.result_stream)
        left = await client.zcard(queues.processing_set)
        await client.aclose()
        return results, stream, left

    results, stream, left = asyncio.run(main())
    got = by_id(results)
    assert sorted(got) == ["l0", "l1", "z0", "z1", "z2"]
    for r in results:
        assert r["status_code"] == 200 and "error_code" not in r
        body = json.loads(r["payload"])
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["prompt_tokens"] > 0
    assert stream == 5 and left == 0
    assert fresh_sim.stats()["answered"] == 5


def test_expired_message_gets_deadline_exceeded_and_is_not_sent(fresh_sim, valkey_url, prefix):
    queues = names(prefix)

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        await submit(client, message("late", deadline_in=-1), sortedset=queues.request_sortedset)
        await submit(client, message("fine"), sortedset=queues.request_sortedset)
        async with running(settings(fresh_sim, valkey_url, queues)):
            results = await wait_results(client, queues.result_list, 2)
        await client.aclose()
        return by_id(results)

    got = asyncio.run(main())
    assert got["late"]["error_code"] == DEADLINE_EXCEEDED and "status_code" not in got["late"]
    assert got["fine"]["status_code"] == 200
    assert fresh_sim.stats()["received"] == 1  # the expired one never reached the provider


def test_malformed_messages_get_invalid_request_and_the_worker_goes_on(
    fresh_sim, valkey_url, prefix
):
    queues = names(prefix, request_list=f"{prefix}:list")
    bad = [
        "not json at all",
        json.dumps({"id": "no-deadline", "payload": {"messages": []}}),
        json.dumps({"id": "str-payload", "deadline": time.time() + 60, "payload": "hi"}),
        json.dumps(message("other-model") | {"payload": {"model": "gpt-9", "messages": []}}),
        json.dumps(message("completions", endpoint="/v1/completions")),
        json.dumps(message("prompt") | {"payload": {"model": MODEL, "prompt": "hi"}}),
    ]

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        for raw in bad:
            await client.lpush(queues.request_list, raw)
        await submit(client, message("good"), list_name=queues.request_list)
        async with running(settings(fresh_sim, valkey_url, queues)):
            results = await wait_results(client, queues.result_list, len(bad) + 1)
        await client.aclose()
        return results

    results = asyncio.run(main())
    invalid = [r for r in results if r.get("error_code") == INVALID_REQUEST]
    assert len(invalid) == len(bad)
    assert {r["id"] for r in invalid} >= {"no-deadline", "str-payload", "other-model"}
    assert any("deadline" in r["error_message"] for r in invalid)
    assert any("gpt-9" in r["error_message"] for r in invalid)
    assert "completions" in by_id(invalid)["prompt"]["error_message"]
    assert [r["id"] for r in results if r.get("status_code") == 200] == ["good"]
    assert fresh_sim.stats()["received"] == 1


def test_5xx_is_retried_with_backoff_until_it_succeeds(fresh_sim, valkey_url, prefix):
    queues = names(prefix)
    fresh_sim.configure(fail_500=1.0)

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        await submit_envelope(client, message("flaky"), queues.request_sortedset)
        async with running(settings(fresh_sim, valkey_url, queues)) as parts:
            while fresh_sim.stats().get("fault_500", 0) < 3:
                await asyncio.sleep(0.05)
            pipe = client.pipeline(transaction=True)  # one atomic look at all three places
            for key in (queues.retry_sortedset, queues.request_sortedset, queues.processing_set):
                pipe.zcard(key)
            assert sum(await pipe.execute()) == 1
            fresh_sim.configure(fail_500=0.0)
            results = await wait_results(client, queues.result_list, 1)
            retried = sample(parts, "llm_d_async_async_request_retries_total", queues)
            first = sample(parts, "llm_d_async_async_request_total", queues)
        await client.aclose()
        return results, retried, first

    started = time.monotonic()
    (result,), retried, first = asyncio.run(main())
    assert result["status_code"] == 200
    assert first == 1 and retried >= 3  # the envelope's retry_count went up on each retry
    # Three failures with 0.2, 0.4, 0.8 s backoff (minus up to 25 % jitter): spaced, not spun.
    assert time.monotonic() - started >= 0.2 * 0.75 + 0.4 * 0.75
    assert fresh_sim.stats()["fault_500"] <= 4


def test_5xx_until_the_deadline_ends_deadline_exceeded(fresh_sim, valkey_url, prefix):
    queues = names(prefix)
    fresh_sim.configure(fail_500=1.0)

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        await submit(client, message("doomed", deadline_in=2.0), sortedset=queues.request_sortedset)
        async with running(settings(fresh_sim, valkey_url, queues)) as parts:
            results = await wait_results(client, queues.result_list, 1)
            retries = sample(parts, "llm_d_async_async_request_retries_total", queues)
        await client.aclose()
        return results, retries

    (result,), retries = asyncio.run(main())
    assert result["error_code"] == DEADLINE_EXCEEDED
    faults = fresh_sim.stats()["fault_500"]
    assert 2 <= faults <= 6  # exponential backoff within 2 s, not a tight loop
    assert retries >= faults - 1


def test_results_are_idempotent_by_id(fresh_sim, valkey_url, prefix):
    queues = names(prefix, request_list=f"{prefix}:list")

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        await submit(client, message("once"), sortedset=queues.request_sortedset)
        async with running(settings(fresh_sim, valkey_url, queues)) as parts:
            await wait_results(client, queues.result_list, 1)
            # The producer re-sends the same id (both transports): no second send, no result.
            await submit(client, message("once"), sortedset=queues.request_sortedset)
            await submit(client, message("once"), list_name=queues.request_list)
            await submit(client, message("after"), sortedset=queues.request_sortedset)
            await wait_results(client, queues.result_list, 2)
            await asyncio.sleep(0.3)
            # Two workers finishing the same message: the second result is dropped.
            second = await parts.lanes[0].queue.ack(Held(b"member-x"), '{"id":"once"}', "once")
        rows = await client.lrange(queues.result_list, 0, -1)
        await client.aclose()
        return [json.loads(r)["id"] for r in rows], second

    ids, second = asyncio.run(main())
    assert sorted(ids) == ["after", "once"]
    assert second is False
    assert fresh_sim.stats()["received"] == 2


def test_cancelled_message_is_not_sent(fresh_sim, valkey_url, prefix):
    queues = names(prefix)

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        await client.set(cancel_key(f"{prefix}-gone"), "token", ex=60)  # llm-d's marker
        await submit(client, message(f"{prefix}-gone"), sortedset=queues.request_sortedset)
        await submit(client, message(f"{prefix}-kept"), sortedset=queues.request_sortedset)
        async with running(settings(fresh_sim, valkey_url, queues)):
            results = await wait_results(client, queues.result_list, 2)
        await client.aclose()
        return by_id(results)

    got = asyncio.run(main())
    assert got[f"{prefix}-gone"]["error_code"] == CANCELLED
    assert got[f"{prefix}-kept"]["status_code"] == 200
    assert fresh_sim.stats()["received"] == 1


def test_metrics_endpoint_exposes_llm_d_and_limiter_names(fresh_sim, valkey_url, prefix):
    queues = names(prefix)

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        await submit(client, message("m1"), sortedset=queues.request_sortedset)
        await submit(client, message("m2", deadline_in=-5), sortedset=queues.request_sortedset)
        async with running(settings(fresh_sim, valkey_url, queues, rpm=6000)) as parts:
            await wait_results(client, queues.result_list, 2)
            runner, port = await start_metrics_server(parts.metrics, "127.0.0.1", 0)
            try:
                url = f"http://127.0.0.1:{port}/metrics"
                text = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
            finally:
                await runner.cleanup()
        await client.aclose()
        return text

    text = asyncio.run(main())
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    q = queues.request_sortedset
    queue = (("pool_name", "default"), ("queue_id", q), ("queue_name", q))

    def value(name: str, *extra: tuple[str, str]) -> float:
        return samples[(name, tuple(sorted(queue + extra)))]

    assert value("llm_d_async_async_request_total") == 2
    assert value("llm_d_async_async_successful_requests_total") == 1
    assert value("llm_d_async_async_exceeded_deadline_requests_total") == 1
    assert value("llm_d_async_async_inference_latency_time_millis_count") == 1
    assert value("batch_llm_worker_dispatched_requests_total") == 1
    assert value("batch_llm_worker_tokens_total", ("direction", "input")) > 0
    assert value("batch_llm_worker_tokens_total", ("direction", "output")) > 0
    assert value("batch_llm_worker_limiter_grants_total") == 1
    assert value("batch_llm_worker_limiter_granted_tokens_total") > 0  # the grant's reservation
    assert value("batch_llm_worker_limiter_wait_seconds_count") == 1
    assert samples[("llm_d_async_async_pool_worker_limit", (("pool_name", "default"),))] == 8
    exposed = {name for name, _ in samples}
    for name in (
        "llm_d_async_async_request_retries_total",
        "llm_d_async_async_failed_requests_total",
        "llm_d_async_async_shedded_requests_total",
        "llm_d_async_async_queue_depth",
        "llm_d_async_async_inflight_requests",
        "llm_d_async_async_broker_backlog",
        "batch_llm_worker_http_429_total",
        "batch_llm_worker_limiter_slowdown_factor",
    ):
        assert name in exposed, name


def test_a_429_slows_the_metered_limiter_and_shows_in_its_gauge(valkey_url):
    # The worker's limiter reports to its metrics. Its 429 path took keyword arguments only, so
    # the engine's `penalize(grant, retry_after_s=...)` raised TypeError out of the request.
    from batch_llm_assets.engine import LimiterSettings
    from batch_llm_assets.worker.metrics import MeteredLimiter, WorkerMetrics

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        limiter = MeteredLimiter(
            client, namespace=f"test:{{{uuid.uuid4().hex[:12]}}}", settings=LimiterSettings(rpm=60)
        )
        limiter.metrics = WorkerMetrics().queue("q", "q")
        grant = await limiter.acquire(1)
        await limiter.penalize(grant, retry_after_s=None)
        await client.aclose()
        return limiter.metrics.slowdown._value.get()

    assert asyncio.run(main()) == pytest.approx(0.7)
