"""The worker's intake on real Valkey and the simulator over HTTP: what is refused before
anything is paid (stream, deadlines, roles, typed params), a bad field the claim scripts meet,
and answers that carry a lone surrogate (issue 27)."""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid

import pytest
import redis.asyncio as aioredis

from batch_llm_assets.worker import INVALID_REQUEST, submit

from .test_worker import by_id, message, names, running, settings, wait_results


@pytest.fixture
def prefix():
    return f"wi{uuid.uuid4().hex[:10]}"


async def serve_list(sim, url: str, queues, members: list[str], n_results: int, **kw) -> dict:
    """LPUSH raw members, serve them, return the results by id."""
    client = aioredis.Redis.from_url(url)
    for raw in members:
        await client.lpush(queues.request_list, raw)
    async with running(settings(sim, url, queues, **kw)):
        results = await wait_results(client, queues.result_list, n_results, timeout=15)
    await client.aclose()
    return by_id(results)


def with_payload(msg_id: str, **params) -> str:
    msg = message(msg_id)
    msg["payload"] |= params
    return json.dumps(msg)


def test_stream_must_be_false_or_absent(fresh_sim, valkey_url, prefix):
    """stream true, 1 or "true" were sent (1 and true passed `in (None, False, 1)`): refused."""
    queues = names(prefix, request_list=f"{prefix}:list")
    members = [
        with_payload("s-true", stream=True),
        with_payload("s-one", stream=1),
        with_payload("s-text", stream="true"),
        with_payload("s-false-text", stream="false"),
        with_payload("s-false", stream=False),
        with_payload("s-null", stream=None),
        with_payload("n-two", n=2),
        with_payload("n-true", n=True),
    ]
    got = asyncio.run(serve_list(fresh_sim, valkey_url, queues, members, len(members)))
    for bad in ("s-true", "s-one", "s-text", "s-false-text", "n-two", "n-true"):
        assert got[bad]["error_code"] == INVALID_REQUEST, bad
    assert "stream must be false or absent" in got["s-one"]["error_message"]
    assert got["s-false"]["status_code"] == 200 and got["s-null"]["status_code"] == 200
    assert fresh_sim.stats()["received"] == 2


def test_deadlines_must_be_finite_unix_seconds(fresh_sim, valkey_url, prefix):
    """A deadline in milliseconds never expired; NaN was accepted (and lost on a reclaim)."""
    queues = names(prefix, request_list=f"{prefix}:list")
    now = time.time()
    deadlines = {
        "ms": now * 1000,
        "nan": math.nan,
        "inf": math.inf,
        "minus-inf": -math.inf,
        "relative": 60,
        "text": str(int(now + 60)),
        "bool": True,
    }
    members = [json.dumps(message(k) | {"deadline": v}) for k, v in deadlines.items()]
    members.append(json.dumps(message("fine")))
    got = asyncio.run(serve_list(fresh_sim, valkey_url, queues, members, len(members)))
    for k in deadlines:
        assert got[k]["error_code"] == INVALID_REQUEST, k
        assert "deadline" in got[k]["error_message"], k
    assert "milliseconds" in got["ms"]["error_message"]
    assert "finite" in got["nan"]["error_message"]
    assert "before 2001" in got["relative"]["error_message"]
    assert got["fine"]["status_code"] == 200
    assert fresh_sim.stats()["received"] == 1


def test_a_chat_message_without_role_is_told_so(fresh_sim, valkey_url, prefix):
    """It was answered "prompt is null or empty"."""
    queues = names(prefix, request_list=f"{prefix}:list")
    no_role = message("no-role")
    no_role["payload"]["messages"] = [{"content": "is this up or down?"}]
    bad_role = message("bad-role")
    bad_role["payload"]["messages"] = [{"role": 7, "content": "up or down?"}]
    bad_content = message("bad-content")
    bad_content["payload"]["messages"] = [{"role": "user", "content": {"text": "up?"}}]
    members = [json.dumps(m) for m in (no_role, bad_role, bad_content)]
    got = asyncio.run(serve_list(fresh_sim, valkey_url, queues, members, 3))
    assert got["no-role"]["error_code"] == INVALID_REQUEST
    assert "messages[0] has no role" in got["no-role"]["error_message"]
    assert "role must be a non-empty string" in got["bad-role"]["error_message"]
    assert "content must be" in got["bad-content"]["error_message"]
    assert fresh_sim.stats().get("received", 0) == 0


def test_numeric_params_are_typed_before_anything_is_paid(fresh_sim, valkey_url, prefix):
    """ "max_tokens": "lots" raised in the engine: the message was reclaimed and failed again
    every visibility timeout, never answered. Now each wrong type is refused by name."""
    queues = names(prefix, request_list=f"{prefix}:list")
    bad = {
        "lots": {"max_tokens": "lots"},
        "true": {"max_tokens": True},
        "half": {"max_tokens": 1.5},
        "zero": {"max_completion_tokens": 0},
        "hot": {"temperature": "hot"},
        "nan": {"top_p": math.nan},
        "seed": {"seed": "42"},
    }
    members = [with_payload(k, **v) for k, v in bad.items()]
    members.append(with_payload("fine", temperature=0, max_tokens=8, seed=1))
    got = asyncio.run(serve_list(fresh_sim, valkey_url, queues, members, len(members)))
    for k, params in bad.items():
        assert got[k]["error_code"] == INVALID_REQUEST, k
        assert f"payload.{next(iter(params))}" in got[k]["error_message"], k
    assert got["fine"]["status_code"] == 200
    assert fresh_sim.stats()["received"] == 1


def test_claim_scripts_keep_a_message_with_a_nan_deadline(fresh_sim, valkey_url, prefix):
    """Reclaimed from processing or back from the retry set, a NaN deadline made the claim
    script's ZADD fail after its ZREM: 22 messages, 21 results. Now every one is answered."""
    queues = names(prefix)
    good = [f"g{i}" for i in range(20)]
    nan_member = json.dumps(message("nan-reclaimed") | {"deadline": math.nan})
    inf_member = json.dumps(message("inf-retried") | {"deadline": math.inf})

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        for i in good:
            await submit(client, message(i), sortedset=queues.request_sortedset)
        # Left by a dead worker (visibility long expired), and due in the retry set.
        await client.zadd(queues.processing_set, {nan_member: 0})
        await client.zadd(queues.retry_sortedset, {inf_member: 0})
        async with running(settings(fresh_sim, valkey_url, queues)):
            results = await wait_results(client, queues.result_list, len(good) + 2, timeout=15)
        left = [
            await client.zcard(k)
            for k in (queues.request_sortedset, queues.processing_set, queues.retry_sortedset)
        ]
        await client.aclose()
        return by_id(results), left

    got, left = asyncio.run(main())
    assert got["nan-reclaimed"]["error_code"] == INVALID_REQUEST
    assert got["inf-retried"]["error_code"] == INVALID_REQUEST
    assert all(got[i]["status_code"] == 200 for i in good)
    assert left == [0, 0, 0]
    assert fresh_sim.stats()["received"] == len(good)


def test_an_answer_with_a_lone_surrogate_is_stored_once(fresh_sim, valkey_url, prefix):
    """The result could not be written (UnicodeEncodeError): the message was sent again every
    visibility timeout, for ever (3 messages, 12 paid requests, 0 results in 40 s)."""
    queues = names(prefix)
    fresh_sim.configure(surrogate_every=1)
    ids = ["u0", "u1", "u2"]

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        for i in ids:
            await submit(client, message(i), sortedset=queues.request_sortedset)
        async with running(settings(fresh_sim, valkey_url, queues)):
            results = await wait_results(client, queues.result_list, len(ids), timeout=10)
        await client.aclose()
        return results

    results = asyncio.run(main())
    assert sorted(r["id"] for r in results) == ids
    for r in results:
        content = json.loads(r["payload"])["choices"][0]["message"]["content"]
        assert r["status_code"] == 200 and content.endswith("\ufffd")
    stats = fresh_sim.stats()
    assert stats["fault_surrogate"] == len(ids) and stats["received"] == len(ids)


def test_odd_ids_get_one_result_each(fresh_sim, valkey_url, prefix):
    """A lone surrogate (a JSON escape) or 100,000 characters in an id: sent once, answered."""
    queues = names(prefix, request_list=f"{prefix}:list")
    long_id = "x" * 100_000
    members = [json.dumps(message("\ud83d-odd")), json.dumps(message(long_id))]
    got = asyncio.run(serve_list(fresh_sim, valkey_url, queues, members, 2))
    assert got["\ufffd-odd"]["status_code"] == 200  # the id as Redis can store it
    assert got[long_id]["status_code"] == 200
    assert fresh_sim.stats()["received"] == 2


def test_a_member_that_is_not_utf8_is_answered_and_leaves_processing(fresh_sim, valkey_url, prefix):
    """Removed by the text it was decoded to, it stayed in processing and was reclaimed after
    every visibility timeout. Members stay bytes: answered once, gone."""
    queues = names(prefix, request_list=f"{prefix}:list")

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        await client.lpush(queues.request_list, b'{"id": "\xff\xfe", "deadline": 1')
        async with running(settings(fresh_sim, valkey_url, queues)):
            (result,) = await wait_results(client, queues.result_list, 1)
            processing = await client.zcard(queues.processing_set)
        await client.aclose()
        return result, processing

    result, processing = asyncio.run(main())
    assert result["error_code"] == INVALID_REQUEST and processing == 0
