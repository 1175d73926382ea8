"""Every engine on a key hears a restart of the shared schedule (limiter.lua publishes each new
epoch): another process's 429 wakes this engine's sleepers at once, a storm of restarts does not
keep a request from being sent, and a lost or rolled-back state, or an epoch no script could
make, does not stop an engine."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest
import redis
import redis.asyncio as aioredis

from batch_llm_assets.engine import Grant, LimiterSettings, RedisLimiter
from batch_llm_assets.engine import _constants as C
from batch_llm_assets.engine.pacing import Pacer

pytestmark = pytest.mark.usefixtures("fresh_limiter_state")


def _this_and_another_process(valkey_url: str) -> tuple[RedisLimiter, RedisLimiter]:
    """Two engines' limiters on one key, each with its own client (two processes), 10/s."""
    ns = f"test:two-processes:{uuid.uuid4().hex}"
    settings = LimiterSettings(rpm=600, reach_s=1.0)
    return tuple(  # type: ignore[return-value]
        RedisLimiter(aioredis.Redis.from_url(valkey_url), namespace=ns, settings=settings, job=j)
        for j in ("a", "b")
    )


async def _close(*limiters: RedisLimiter) -> None:
    async with asyncio.timeout(5):  # the listener stops with the engine
        for lim in limiters:
            await lim.release()
    for lim in limiters:
        await lim._redis.aclose()


def test_another_process_s_429_reaches_the_sleepers_at_once(valkey_url):
    # Eight requests, each granted a slot at once (0.1 s apart, all within the reach), so this
    # engine has nothing more to ask Redis. Another process (its own client) gets a 429 and
    # pauses the key for 1.5 s. limiter.lua publishes the new epoch; the sleepers hear it and
    # take fresh slots after the pause. Without it they would all go out during the pause.
    async def main():
        lim, other = _this_and_another_process(valkey_url)
        pacer = Pacer(lim)
        sends: list[tuple[float, int]] = []

        async def one():
            grant = await pacer.slot(1, 0, None)
            sends.append((time.monotonic(), grant.epoch))

        tasks = [asyncio.create_task(one()) for _ in range(8)]
        while len(sends) < 2:
            await asyncio.sleep(0.01)
        await other.penalize(await other.acquire(1), retry_after_s=1.5)
        penalized = time.monotonic()
        await asyncio.gather(*tasks)
        await _close(lim, other)
        return penalized, sends

    penalized, sends = asyncio.run(main())
    assert len(sends) == 8
    stale = [
        round(t - penalized, 3) for t, epoch in sends if t > penalized and epoch <= sends[0][1]
    ]
    # At most one: a slot due in the instant between the script and the message.
    assert len(stale) <= 1, stale


def test_a_request_takes_two_fresh_slots_at_most_however_often_the_schedule_restarts(valkey_url):
    # Another process's 429s come one after another, each with a half-second hint: each restarts
    # the schedule past a new pause and wakes this engine's sleepers. A request takes a fresh
    # slot MAX_FRESH_SLOTS times at most, then sleeps to the one it holds and is sent: it is not
    # asked again at every restart for as long as the storm lasts.
    async def main():
        lim, other = _this_and_another_process(valkey_url)
        pacer = Pacer(lim)
        acquire, asks = lim.acquire, []

        async def counted(*args, **kwargs):  # a spy: the real acquire, counted
            asks.append(time.monotonic())
            return await acquire(*args, **kwargs)

        lim.acquire = counted  # type: ignore[method-assign]
        sending = asyncio.create_task(pacer.slot(1, 0, None))
        restarts = 0
        while not sending.done() and restarts < 30:
            await other.penalize(Grant(0.0, epoch=2**52), retry_after_s=0.5)
            restarts += 1
            await asyncio.sleep(0.1)
        await sending
        await _close(lim, other)
        return len(asks), restarts

    asks, restarts = asyncio.run(main())
    assert asks <= 1 + C.MAX_FRESH_SLOTS, (asks, restarts)
    assert restarts < 30  # sent while the restarts went on


def test_a_redis_user_without_channel_rights_still_gets_its_grants(valkey_url, caplog):
    # Redis 7's ACL users have no pub/sub channels unless granted. The limiter's script tells a
    # new epoch to the other engines on the key over a channel; for such a user it must still
    # grant, penalize and restart (pcall), and the listener only warns.
    admin = redis.Redis.from_url(valkey_url)
    admin.execute_command(
        "ACL", "SETUSER", "nochannels", "on", ">pw", "~*", "+@all", "resetchannels"
    )
    admin.close()
    url = valkey_url.replace("redis://", "redis://nochannels:pw@", 1)

    async def main():
        client = aioredis.Redis.from_url(url)
        lim = RedisLimiter(
            client, namespace=f"test:acl:{uuid.uuid4().hex}", settings=LimiterSettings(rpm=600)
        )
        first = await lim.acquire(1)
        await lim.penalize(first, retry_after_s=0.2)
        after = await lim.acquire(1)
        async with asyncio.timeout(5):
            await asyncio.wait({lim._watcher})  # refused: the listener stops, no retry loop
            await lim.release()
        await client.aclose()
        return first, after

    with caplog.at_level(logging.WARNING):
        first, after = asyncio.run(main())
    assert first.granted and after.granted and after.epoch == first.epoch + 1
    assert after.wait_s >= 0.1  # the pause held
    refusals = [r for r in caplog.records if "Not hearing" in r.getMessage()]
    assert len(refusals) == 1 and "for this engine's life" in refusals[0].getMessage()


async def _acquires_after_the_state_is_lost(url: str, *, epoch_ahead: int) -> tuple[int, int]:
    """The newest epoch an engine saw (after a 429, with the old server's epoch moved
    `epoch_ahead` ms ahead) and the acquires three requests take once the key's state is gone."""
    client = aioredis.Redis.from_url(url)
    ns = f"test:state-lost:{uuid.uuid4().hex}"
    lim = RedisLimiter(client, namespace=ns, settings=LimiterSettings(rpm=6000), job="a")
    pacer = Pacer(lim)
    first = await pacer.slot(1, 0, None)
    if epoch_ahead:
        await client.hset(lim._keys[0], "ep", first.epoch + epoch_ahead)
    await lim.penalize(first, retry_after_s=None)
    await pacer.slot(1, 0, None)
    seen = pacer._epoch
    await client.delete(*[k async for k in client.scan_iter(f"{ns}:*")])
    asks = 0
    call = lim._call

    async def counted(op, *args, **kw):
        nonlocal asks
        asks += op == "acquire"
        return await call(op, *args, **kw)

    lim._call = counted
    grants = [await pacer.slot(1, 0, None) for _ in range(3)]
    await lim.release()
    await client.aclose()
    assert all(g.granted for g in grants)
    return seen, asks


def test_an_engine_goes_on_when_the_key_s_state_is_lost(valkey_url):
    # The key's state expires after an idle minute (a queue worker between messages), or a
    # failover lands on a server without it. An engine that saw a 429 before must not take the
    # new state's slots for stale ones: before, its epochs counted again from 0, every grant was
    # older than the one it had seen, and each request took two fresh slots before it went.
    _, asks = asyncio.run(_acquires_after_the_state_is_lost(valkey_url, epoch_ahead=0))
    assert asks == 3


def test_an_engine_goes_on_when_the_state_comes_back_with_a_lower_epoch(valkey_url):
    # A failover to a server whose clock is behind, which has lost the key's state: the new
    # state's epoch (that server's time in ms) is lower than the one the engine saw. The old
    # server's epoch is set ahead here to stand for it. Before, every grant of the new state
    # looked stale and each request took two fresh slots before it went, for the key's life.
    seen, asks = asyncio.run(_acquires_after_the_state_is_lost(valkey_url, epoch_ahead=10**9))
    assert seen > time.time() * 1000 + 10**8  # the new state's own epoch would be lower
    assert asks == 3


def test_an_epoch_no_script_could_make_is_not_heard(valkey_url):
    # Anyone with write access to Redis can publish on the key's channel. What is heard there
    # reaches the state (every call carries the newest epoch seen): a huge integer must not,
    # or the state's epoch would jump past what a Lua number holds exactly (and past 2^63,
    # what a Redis integer reply holds). Junk is ignored; a real epoch after it is heard.
    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        ns = f"test:junk-epoch:{uuid.uuid4().hex}"
        lim = RedisLimiter(client, namespace=ns, settings=LimiterSettings(rpm=600))
        first = await lim.acquire(1)
        channel = f"{ns}:state:epoch"
        while (await client.pubsub_numsub(channel))[0][1] == 0:
            await asyncio.sleep(0.01)
        for junk in (
            10**30,
            2**63,
            2**53,
            -5,
            "nan",
            "1e400",
            "\udcff".encode("utf-8", "surrogatepass"),
        ):
            await client.publish(channel, junk if isinstance(junk, bytes) else str(junk))
        await client.publish(channel, first.epoch + 1)
        while lim.epoch <= first.epoch:  # the channel keeps order: the junk was read first
            await asyncio.sleep(0.01)
        heard = lim.epoch
        after = await lim.acquire(1)
        await lim.release()
        await client.aclose()
        return first, heard, after

    first, heard, after = asyncio.run(main())
    assert heard == first.epoch + 1
    assert after.epoch == first.epoch + 1 and after.granted
