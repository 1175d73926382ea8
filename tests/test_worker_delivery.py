"""Every message ends with exactly one result, paid at most once (issue 27), on real Valkey
and the simulator over HTTP, counted at the simulator: dead letters after max_deliveries,
duplicate ids in flight, and the breaker's scopes, cool-down and probe."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
import redis.asyncio as aioredis

from batch_llm_assets.worker import (
    DEADLINE_EXCEEDED,
    INFERENCE_ERROR,
    INVALID_REQUEST,
    RedisQueue,
    submit,
)

from .test_worker import by_id, message, names, running, sample, settings, wait_results


@pytest.fixture
def prefix():
    return f"wd{uuid.uuid4().hex[:10]}"


async def wait_for(check, what: str, timeout: float = 15.0):
    """Poll an async check until it returns something truthy."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


async def left_in(client, queues) -> list[int]:
    """Messages still in the request set, processing and retry sets."""
    keys = (queues.request_sortedset, queues.processing_set, queues.retry_sortedset)
    return [await client.zcard(k) for k in keys]


def test_a_result_that_cannot_be_written_is_dead_lettered_and_paid_once(
    fresh_sim, valkey_url, prefix
):
    """A result that cannot be stored left the message in processing, sent again after every
    visibility timeout, for ever. Now the answer is recorded before the write, re-used on each
    delivery (never paid again), and after max_deliveries the message is dead-lettered with it."""
    queues = names(prefix)
    dead_letters = f"{queues.request_sortedset}:dead-letter"  # the default name

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        await client.set(queues.result_list, "not a list")  # LPUSH fails WRONGTYPE
        await submit(client, message("unwritable"), sortedset=queues.request_sortedset)
        async with running(settings(fresh_sim, valkey_url, queues)) as parts:
            await wait_for(lambda: client.llen(dead_letters), "dead letter")
            dead = sample(parts, "batch_llm_worker_dead_lettered_messages_total", queues)
            failed = sample(parts, "batch_llm_worker_failed_deliveries_total", queues)
        entries = await client.lrange(dead_letters, 0, -1)
        left = await left_in(client, queues)
        await client.aclose()
        return [json.loads(e) for e in entries], dead, failed, left

    (entry,), dead, failed, left = asyncio.run(main())
    assert entry["id"] == "unwritable" and entry["deliveries"] == 3
    assert "WRONGTYPE" in entry["cause"]
    assert json.loads(entry["answer"])["status_code"] == 200  # the paid answer is kept
    assert json.loads(entry["message"])["id"] == "unwritable"
    assert json.loads(entry["result"])["error_code"] == INFERENCE_ERROR
    assert (dead, failed) == (1, 3)
    assert left == [0, 0, 0]
    assert fresh_sim.stats()["received"] == 1  # three deliveries, one payment


def test_handling_that_raises_is_delivered_max_deliveries_times_then_answered(
    fresh_sim, valkey_url, prefix
):
    """Any exception while handling a message left it in processing, failing again every
    visibility timeout, never answered. Here the id's answer key holds another type (so the
    lookup before sending raises): two deliveries (--max-deliveries 2), then an error result
    naming the cause and a dead letter under the configured name."""
    queues = names(prefix, dead_letter=f"{prefix}:dlq")

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        await client.hset(f"{queues.result_list}:answer:raises", "x", "1")
        await submit(client, message("raises"), sortedset=queues.request_sortedset)
        await submit(client, message("fine"), sortedset=queues.request_sortedset)
        async with running(settings(fresh_sim, valkey_url, queues, max_deliveries=2)) as parts:
            results = await wait_results(client, queues.result_list, 2, timeout=15)
            failed = sample(parts, "batch_llm_worker_failed_deliveries_total", queues)
        entries = await client.lrange(f"{prefix}:dlq", 0, -1)
        left = await left_in(client, queues)
        await client.aclose()
        return by_id(results), [json.loads(e) for e in entries], failed, left

    got, (entry,), failed, left = asyncio.run(main())
    assert got["raises"]["error_code"] == INFERENCE_ERROR
    assert "dead-lettered after 2 failed deliveries" in got["raises"]["error_message"]
    assert "WRONGTYPE" in got["raises"]["error_message"]
    assert entry["id"] == "raises" and entry["answer"] is None
    assert got["fine"]["status_code"] == 200
    assert failed == 2 and left == [0, 0, 0]
    assert fresh_sim.stats()["received"] == 1  # only "fine"


def test_a_message_whose_workers_died_holding_it_is_dead_lettered(fresh_sim, valkey_url, prefix):
    """A message that kills its worker (out of memory, say) came back after every visibility
    timeout. Each claim counts a delivery; the fourth claim dead-letters it unsent."""
    queues = names(prefix)

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        await submit(client, message("killer"), sortedset=queues.request_sortedset)
        dying = RedisQueue(client, queues, visibility_ms=0, result_ttl_s=60)
        for n in (1, 2, 3):  # three workers claim it and die (visibility 0: reclaimable at once)
            claim = await dying.claim(1)
            assert claim.deliveries == [n]
        async with running(settings(fresh_sim, valkey_url, queues)):
            (result,) = await wait_results(client, queues.result_list, 1)
        entries = await client.lrange(f"{queues.request_sortedset}:dead-letter", 0, -1)
        left = await left_in(client, queues)
        await client.aclose()
        return result, [json.loads(e) for e in entries], left

    result, (entry,), left = asyncio.run(main())
    assert result["id"] == "killer" and result["error_code"] == INFERENCE_ERROR
    assert "its worker stopped 3 times" in result["error_message"]
    assert entry["deliveries"] == 3 and left == [0, 0, 0]
    assert fresh_sim.stats().get("received", 0) == 0


def test_duplicate_ids_in_flight_are_sent_once(fresh_sim, valkey_url, prefix):
    """20 messages with one id were 20 paid requests and 1 result; now 1 and 1, across two
    workers (the in-flight lock is in Redis)."""
    queues = names(prefix)
    fresh_sim.configure(latency_ms=300)  # all 20 claimed while the first is in flight

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        for i in range(20):
            await submit(
                client, message("dup", text=f"copy {i}"), sortedset=queues.request_sortedset
            )
        s = settings(fresh_sim, valkey_url, queues, concurrency=16)
        async with running(s), running(s):
            await wait_results(client, queues.result_list, 1)
            await wait_for(lambda: _drained(client, queues), "the copies dropped")
        rows = await client.lrange(queues.result_list, 0, -1)
        await client.aclose()
        return [json.loads(r) for r in rows]

    results = asyncio.run(main())
    assert len(results) == 1 and results[0]["status_code"] == 200
    assert fresh_sim.stats()["received"] == 1


async def _drained(client, queues) -> bool:
    return await left_in(client, queues) == [0, 0, 0]


def producer_message(msg_id: str, producer: str, text: str | None = None) -> dict:
    return message(msg_id, text=text) | {"metadata": {"producer": producer}}


def test_the_breaker_holds_one_producer_only_and_closes_after_a_probe(
    fresh_sim, valkey_url, prefix
):
    """After 5 consecutive deterministic 400s from one producer, every later message of every
    producer failed "not sent" until the worker restarted (40 of 40). Now the other producer's
    messages are answered, and the failing producer's next message waits for the cool-down,
    then probes the breaker and closes it."""
    queues = names(prefix)
    fresh_sim.configure(fail_marker="POISON")
    s = settings(fresh_sim, valkey_url, queues, breaker_cooldown_s=2.0)
    bad = [f"a-bad{i}" for i in range(5)]
    good = [f"b{i}" for i in range(10)]

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        async with running(s) as parts:
            for i in bad:
                msg = producer_message(i, "a", text=f"POISON {i}")
                await submit(client, msg, sortedset=queues.request_sortedset)
            await wait_results(client, queues.result_list, len(bad))
            opened = sample(parts, "batch_llm_worker_breaker_open_scopes", queues)
            for i in good:
                await submit(client, producer_message(i, "b"), sortedset=queues.request_sortedset)
            await submit(
                client, producer_message("a-good", "a"), sortedset=queues.request_sortedset
            )
            results = await wait_results(client, queues.result_list, len(bad) + len(good) + 1)
            held = sample(parts, "batch_llm_worker_breaker_held_messages_total", queues)
            closed = sample(parts, "batch_llm_worker_breaker_open_scopes", queues)
        await client.aclose()
        return by_id(results), opened, held, closed

    got, opened, held, closed = asyncio.run(main())
    assert all(got[i]["error_code"] == INVALID_REQUEST for i in bad)
    assert all(got[i]["status_code"] == 200 for i in good)
    assert got["a-good"]["status_code"] == 200  # the probe, after the cool-down
    assert (opened, closed) == (1, 0) and held >= 1
    assert fresh_sim.stats()["received"] == len(bad) + len(good) + 1


def test_an_endpoint_out_of_credit_holds_every_message_until_a_probe_is_answered(
    fresh_sim, valkey_url, prefix
):
    """Out of credit, the engine's breaker failed every later message for the life of the
    worker. Now they wait (not failed, not sent) and flow again once a probe is answered."""
    queues = names(prefix)
    fresh_sim.configure(insufficient_quota=True)
    ids = [f"q{i}" for i in range(4)]
    s = settings(fresh_sim, valkey_url, queues, breaker_cooldown_s=0.3)

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        for i in ids:
            await submit(client, message(i), sortedset=queues.request_sortedset)
        async with running(s) as parts:

            async def opened():
                return sample(parts, "batch_llm_worker_breaker_open_scopes", queues) == 1

            await wait_for(opened, "the endpoint's breaker open")
            assert await client.llen(queues.result_list) == 0  # held, not failed
            fresh_sim.configure(insufficient_quota=False)  # credit added
            results = await wait_results(client, queues.result_list, len(ids))
            closed = sample(parts, "batch_llm_worker_breaker_open_scopes", queues)
        await client.aclose()
        return results, closed

    results, closed = asyncio.run(main())
    assert sorted(r["id"] for r in results) == ids
    assert all(r["status_code"] == 200 for r in results) and closed == 0
    stats = fresh_sim.stats()
    assert stats["answered"] == len(ids)
    assert stats["insufficient_quota"] <= len(ids) + 3  # the first wave, then a few probes


def test_a_held_message_whose_deadline_comes_first_says_why(fresh_sim, valkey_url, prefix):
    """A message held by an open breaker past its deadline ends DEADLINE_EXCEEDED, naming the
    breaker, never sent."""
    queues = names(prefix)
    fresh_sim.configure(insufficient_quota=True)
    s = settings(fresh_sim, valkey_url, queues, breaker_cooldown_s=30.0)

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        await submit(client, message("first"), sortedset=queues.request_sortedset)
        async with running(s):
            await wait_for(
                lambda: _count(fresh_sim, "insufficient_quota"), "the first out-of-credit answer"
            )
            await submit(client, message("late", deadline_in=3), sortedset=queues.request_sortedset)
            results = await wait_results(client, queues.result_list, 1)
        await client.aclose()
        return by_id(results)

    got = asyncio.run(main())
    assert got["late"]["error_code"] == DEADLINE_EXCEEDED
    assert "breaker open for endpoint" in got["late"]["error_message"]
    assert fresh_sim.stats()["insufficient_quota"] == 1  # "late" was never sent


async def _count(sim, key: str) -> int:
    return (await asyncio.to_thread(sim.stats)).get(key, 0)


def test_delivery_settings_from_flags_and_env(monkeypatch):
    import argparse

    from batch_llm_assets.worker.cli import add_arguments, settings_from_args

    monkeypatch.setenv("REDIS_URL", "redis://queue:6379/0")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://gateway/v1")
    monkeypatch.setenv("BATCH_LLM_WORKER_MAX_DELIVERIES", "5")
    p = argparse.ArgumentParser()
    add_arguments(p)
    s = settings_from_args(p.parse_args(["--model", "m", "--breaker-cooldown", "1m"]))
    s.validate()
    assert (s.max_deliveries, s.breaker_cooldown_s) == (5, 60.0)
    assert s.queues.dead_letter_list == "request-sortedset:dead-letter"
    s = settings_from_args(p.parse_args(["--model", "m", "--redis.dead-letter-name", "dlq"]))
    assert s.queues.dead_letter_list == "dlq"
    for bad in (["--max-deliveries", "0"], ["--breaker-cooldown", "nan"]):
        with pytest.raises(ValueError, match=r"max_deliveries|breaker_cooldown_s"):
            settings_from_args(p.parse_args(["--model", "m", *bad])).validate()
