"""The shared limiter (limiter.lua through RedisLimiter) on a real Redis-protocol server: the
GCRA schedule and its burst, the minute ceiling, restarts, AIMD, shares, leases, clock steps.
Grants are schedule-ahead, so most cases read the granted send times instead of sleeping."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import random
import time

import pytest
import redis
import redis.asyncio as aioredis

from batch_llm_assets.engine import LimiterSettings, RedisLimiter, limiter_namespace


def _limiter(url, namespace, *, job="job", weight=1.0, **settings):
    # These cases read the granted slots however far ahead they are; the reach (a slot beyond
    # it is not granted: the request waits in line) has its own tests.
    settings.setdefault("reach_s", 3600.0)
    client = aioredis.Redis.from_url(url)
    return client, RedisLimiter(
        client, namespace=namespace, settings=LimiterSettings(**settings), job=job, weight=weight
    )


def run(coro):
    return asyncio.run(coro)


async def _hammer(url, namespace, seconds, tasks, settings, job="job", weight=1.0, seed=0):
    """Acquire as fast as `tasks` workers can for `seconds`; return (send time, tokens) pairs."""
    client, lim = _limiter(url, namespace, job=job, weight=weight, **settings)
    rng = random.Random(seed)
    sends: list[tuple[float, int]] = []
    stop = time.time() + seconds

    async def worker():
        while time.time() < stop:
            cost = rng.randint(20, 80)
            grant = await lim.acquire(cost)
            send_at = time.time() + grant.wait_s
            await asyncio.sleep(grant.wait_s)
            sends.append((send_at, cost))

    await asyncio.gather(*(worker() for _ in range(tasks)))
    await lim.release()
    await client.aclose()
    return sends


def _process_main(url, namespace, seconds, settings, seed, queue):
    queue.put(asyncio.run(_hammer(url, namespace, seconds, 8, settings, job=f"p{seed}", seed=seed)))


def _hammer_until_killed(url, namespace, settings):
    asyncio.run(_hammer(url, namespace, 3600.0, 16, settings, job="dies", seed=7))


def _max_in_window(sends, window, value):
    """Largest sum of value(send) over any window of `window` seconds starting at a send."""
    sends = sorted(sends)
    best, j, total = 0.0, 0, 0.0
    for i, (t, _) in enumerate(sends):
        while j < len(sends) and sends[j][0] < t + window:
            total += value(sends[j])
            j += 1
        best = max(best, total)
        total -= value(sends[i])
    return best


def test_three_processes_never_exceed_limit_plus_burst(redis_url, namespace):
    rpm, tpm, burst = 3000, 60_000, 0.5  # 50 req/s, 1000 tokens/s: tokens bind
    settings = {"rpm": rpm, "tpm": tpm, "burst_s": burst}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_process_main, args=(redis_url, namespace, 4.0, settings, i, queue))
        for i in range(3)
    ]
    for p in procs:
        p.start()
    sends = [s for _ in procs for s in queue.get(timeout=60)]
    for p in procs:
        p.join(timeout=30)
    assert len(sends) > 100
    slack = 0.02  # send times are read client-side, a round trip after Redis decided them
    for window in (0.25, 1.0, 2.0):
        tokens = _max_in_window(sends, window, lambda s: s[1])
        assert tokens <= tpm / 60 * (window + burst + slack) + 80, (window, tokens)
        requests = _max_in_window(sends, window, lambda s: 1)
        assert requests <= rpm / 60 * (window + burst + slack) + 1, (window, requests)
    # ... and it is not idle either: over the whole run the token limit is nearly reached.
    span = max(t for t, _ in sends) - min(t for t, _ in sends)
    assert sum(c for _, c in sends) >= 0.9 * tpm / 60 * span


def test_an_answer_charges_or_gives_back_its_difference(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, tpm=6000, burst_s=0.5)  # 100 tokens/s
        # Granted send times, not waits: a wait counts from its own acquire, and on a busy
        # host the calls between two acquires take a visible part of a second.
        start = time.time()
        first = await lim.acquire(500)
        assert first.wait_s == 0
        before = time.time() + (await lim.acquire(10)).wait_s
        assert 4.4 < before - start < 4.8  # 500 tokens = 5 s; the 0.5 s burst
        await lim.settle(first, tokens=-400)  # the answer used 400 tokens less than reserved
        after = time.time() + (await lim.acquire(10)).wait_s
        assert 0.5 < after - start < 1.0
        await lim.settle(first, tokens=+300)  # a charge pushes the schedule on by 3 s
        charged = time.time() + (await lim.acquire(10)).wait_s
        assert 2.9 < charged - after < 3.3
        await client.aclose()

    run(main())


def test_a_give_back_never_banks_capacity(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, tpm=6000, burst_s=0.5)
        grant = await lim.acquire(10)
        for _ in range(50):  # refunds while alone on the key: no credit piles up
            await lim.settle(grant, tokens=-2_000)
        waits = [(await lim.acquire(25)).wait_s for _ in range(4)]
        assert waits[0] == 0 and waits[1] == 0  # the burst (50 tokens) and no more
        assert waits[3] > 0.2
        await client.aclose()

    run(main())


def test_the_providers_remaining_caps_what_is_promised(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, tpm=60_000, burst_s=0.5)
        grant = await lim.acquire(400)
        assert grant.wait_s == 0  # the burst holds 500
        await lim.settle(grant, view={"rem_t": 0})
        # The provider says nothing remains: the 100 left of the burst are not promised.
        assert (await lim.acquire(50)).wait_s > 0.04
        await client.aclose()

    run(main())


@pytest.mark.parametrize(
    ("dim", "limit", "cost"), [("r", {"rpm": 600}, 0), ("t", {"tpm": 60_000}, 100)]
)
def test_a_spent_window_holds_every_grant_until_its_reset(redis_url, namespace, dim, limit, cost):
    """A window the provider enforces (its answer says: 2 requests, or 2 requests' tokens, left,
    reset in 2 s): the grants of every process come out of what it has left; the third goes at
    the reset, not before, and what waited goes out paced from there (the window was spent, so
    was the burst: a burst of 5 at the reset on top of the pace would overrun a short window).
    Either limit: 10 requests/s."""

    async def main():
        client, one = _limiter(redis_url, namespace, **limit, burst_s=0.5, job="one")
        _, two = _limiter(redis_url, namespace, **limit, burst_s=0.5, job="two")
        grant = await one.acquire(cost)
        before = time.time()
        await one.settle(grant, view={f"rem_{dim}": 2 * max(1, cost), f"reset_{dim}": 2000})
        after = time.time()
        # Granted send times, counted from the settle: a wait is relative to its own acquire,
        # and on a busy host the acquires before it take a visible part of the 2 s.
        waits, sends = [], []
        for lim in (one, two) * 4:
            waits.append((await lim.acquire(cost)).wait_s)
            sends.append(time.time() + waits[-1])
        shown = [round(t - before, 3) for t in sends]
        assert waits[0] < 0.3 and waits[1] < 0.3, waits
        assert before + 1.8 < sends[2] < after + 2.6, shown
        # Paced at 0.1 s from the reset (a burst there would send five at once, the sixth
        # 0.1 s later).
        assert sends[7] - sends[2] > 0.3, shown
        await client.aclose()

    run(main())


def test_a_windows_remaining_does_not_free_the_slots_granted_before_its_reset(redis_url, namespace):
    """A window's remaining counts what it admitted. Slots granted before its reset and not yet
    due are not in it: an answer that says 10 left, while 4 slots are granted ahead, leaves 6
    (as another process's answer would say it, overwriting the count its grants took off)."""

    async def main():
        client, one = _limiter(redis_url, namespace, rpm=600)  # 10/s, no burst
        _, two = _limiter(redis_url, namespace, rpm=600)  # another process of the job
        answered = await one.acquire(0)
        await one.settle(answered, view={"rem_r": 10, "reset_r": 3000})
        reset = time.time() + 3.0
        sends = []
        for _ in range(4):  # granted ahead (0.1-0.4 s), none sent yet
            sends.append(time.time() + (await two.acquire(0)).wait_s)
        await one.settle(answered, view={"rem_r": 10, "reset_r": 2950})
        for _ in range(7):
            sends.append(time.time() + (await one.acquire(0)).wait_s)
        shown = [round(t - reset + 3, 2) for t in sends]
        assert sum(t < reset - 0.2 for t in sends) == 10, shown
        assert sends[-1] > reset - 0.1, shown
        await client.aclose()

    run(main())


def test_the_burst_grows_to_the_providers_bucket_and_shrinks_on_a_429(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, tpm=60_000, burst_s=0.5)  # 1000/s
        grant = await lim.acquire(500)
        # A minute-long bucket, nearly full: the burst grows (and the schedule restarts).
        await lim.settle(grant, view={"cap_ms": 54_000, "rem_t": 59_000})
        assert lim.burst_s == pytest.approx(54, abs=0.01) and lim.epoch == grant.epoch + 1
        burst = [await lim.acquire(1000) for _ in range(40)]
        assert max(g.wait_s for g in burst) == 0  # 40k tokens at once (the configured burst is 500)
        last = await lim.acquire(1000)
        await lim.penalize(last, retry_after_s=None)
        assert lim.burst_s == pytest.approx(0.5)
        # The answer of a request sent before the 429: its headers show the bucket as it was
        # then, nearly full. They do not widen the burst again.
        await lim.settle(burst[0], view={"cap_ms": 54_000, "rem_t": 50_000})
        assert lim.burst_s == pytest.approx(0.5)
        # Paced from now at the slowed rate, not a minute of schedule to wait out.
        assert (await lim.acquire(1000)).wait_s < 2.0
        assert 1.0 < (await lim.acquire(1000)).wait_s < 3.5
        await client.aclose()

    run(main())


def test_the_configured_limit_is_a_ceiling_for_any_minute(redis_url, namespace):
    """A provider bucket of a minute, larger than the configured limit (a team's share of an
    org key): the burst goes as far as the minute allows, and no further, whatever the
    provider says remains."""

    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600, burst_s=0.5)  # 10/s
        grant = await lim.acquire(0)
        await lim.settle(grant, view={"cap_ms": 60_000, "rem_r": 5000})
        grants = [grant] + [await lim.acquire(0) for _ in range(700)]
        start = grants[0].slot_ms
        in_first_minute = sum(1 for g in grants if g.slot_ms < start + 60_000)
        at_once = sum(1 for g in grants if g.wait_s == 0)
        # The free burst's half second of the rate is the tolerance (1 + 0.5/60).
        assert at_once >= 500 and in_first_minute <= 600 * (1 + 0.5 / 60) + 1
        await client.aclose()

    run(main())


def test_a_lower_believed_rate_restarts_the_schedule(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=1200, burst_s=0.5)
        held = [await lim.acquire(0) for _ in range(20)]  # granted at 20/s
        assert lim.believe(rpm=600, tpm=None) and lim.rpm == 600
        assert not lim.believe(rpm=900, tpm=None) and lim.rpm == 900  # up, under the ceiling
        assert not lim.believe(rpm=5000, tpm=None) and lim.rpm == 1200  # never above it
        lim.believe(rpm=600, tpm=None)
        await lim.settle(held[0], view={"restart": 1, "rem_r": 0})
        assert lim.epoch == held[0].epoch + 1
        waits = [(await lim.acquire(0, give_back=g)).wait_s for g in held[1:6]]
        gaps = [b - a for a, b in itertools.pairwise(waits)]
        assert min(gaps) > 0.09, waits  # 10/s now
        await client.aclose()

    run(main())


def test_keys_are_namespaced_without_the_api_key(redis_url):
    secret = "sk-live-do-not-store-1234567890"
    ns = limiter_namespace("https://api.openai.com/v1", "gpt-4o-mini", secret)
    assert secret not in ns and "gpt-4o-mini" in ns
    assert ns != limiter_namespace("https://api.openai.com/v1", "gpt-4o-mini", secret + "x")

    async def main():
        client, lim = _limiter(redis_url, ns, rpm=60, tpm=1000)
        await lim.acquire(10)
        await client.aclose()

    run(main())
    r = redis.Redis.from_url(redis_url)
    keys = [k.decode() for k in r.keys(ns.replace("{", "\\{").replace("}", "\\}") + "*")]
    assert keys and all(secret not in k for k in keys)
    assert all(r.pttl(k) > 0 for k in keys)  # nothing lives forever


@pytest.mark.parametrize("step_ms", [3_600_000, -3_600_000], ids=["back", "forward"])
def test_a_clock_step_neither_stops_nor_runs_the_limiter_ahead(redis_url, namespace, step_ms):
    """A failover to a server whose clock is an hour behind (stored times an hour ahead) or
    ahead (stored times an hour old)."""

    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600, burst_s=0.5)
        grant = await lim.acquire(0)
        await lim.penalize(grant, retry_after_s=None)
        key = f"{namespace}:state"
        st = {k.decode(): float(v) for k, v in (await client.hgetall(key)).items()}
        await client.hset(key, mapping={k: st[k] + step_ms for k in ("tr", "ft", "lt", "pause")})
        grant = await lim.acquire(0)
        assert grant.wait_s < 1.0 and 0.1 <= grant.factor <= 1.0
        # Still limiting: 7/s after the decrease with a 0.5 s burst: the 20th waits ~2 s.
        waits = [(await lim.acquire(0)).wait_s for _ in range(20)]
        assert 1.0 < waits[-1] < 4.0
        await client.aclose()

    run(main())


def test_a_server_that_lost_its_data_does_not_hand_out_slots_already_held(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600, burst_s=0.5)
        waits = [(await lim.acquire(0)).wait_s for _ in range(30)]
        assert waits[-1] > 2.0  # 10 requests/s: the 30th is held about 2.4 s ahead
        await client.delete(f"{namespace}:state")  # the server lost its data
        grant = await lim.acquire(0)
        assert grant.wait_s >= waits[-1] - 0.5, (grant.wait_s, waits[-1])
        await client.aclose()

    run(main())


def test_no_slot_is_granted_beyond_the_reach_and_waiting_reserves_nothing(redis_url, namespace):
    # 120 requests/min: a slot every 0.5 s. Twelve at once: the first go within the burst and
    # the reach, the others wait in line and are granted when their slot comes within a second.
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=120, reach_s=1.0)
        call, asks = lim._call, []

        async def counted(op, *args, **kwargs):
            asks.append(op)
            return await call(op, *args, **kwargs)

        lim._call = counted
        grants = await asyncio.gather(*(lim.acquire(1) for _ in range(12)))
        await client.aclose()
        return grants, asks.count("acquire")

    grants, asks = run(main())
    # Only the line's head asks again: an ask out of the line and about two in it per request,
    # not one per waiter for every grant.
    assert asks <= 3 * len(grants), asks
    assert all(g.granted and g.wait_s <= 1.05 for g in grants), [g.wait_s for g in grants]
    slots = sorted(g.slot_ms for g in grants)
    gaps = [b - a for a, b in itertools.pairwise(slots)]
    # A refused ask reserved nothing: the slots follow each other a second apart, no holes.
    assert all(450 <= g <= 550 for g in gaps[1:]), gaps


def test_requests_waiting_for_the_reach_go_at_the_rate_in_force_when_they_are_granted(
    redis_url, namespace
):
    # The provider states 120/min (0.5 s a slot), then its full 600 (0.1 s), as when the factor
    # recovers after a 429. Twelve requests ask at the slow rate: without the reach each is
    # granted a slot at once, 0.5 s apart (the last 5.5 s out), and the faster rate reaches
    # none of them; with it, those not yet within reach go at the new rate.
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600, reach_s=1.0)
        lim.believe(rpm=120, tpm=None)
        call, replies = lim._call, []

        async def counted(op, *args, **kwargs):
            reply = await call(op, *args, **kwargs)
            replies.append(op)
            return reply

        lim._call = counted
        asks = [asyncio.ensure_future(lim.acquire(1)) for _ in range(12)]
        while len(replies) < 12:  # each has asked once, at the slow rate
            await asyncio.sleep(0.01)
        lim.believe(rpm=600, tpm=None)
        grants = await asyncio.gather(*asks)
        await client.aclose()
        return grants

    slots = sorted(g.slot_ms for g in run(main()))
    assert slots[-1] - slots[0] < 3_000, slots
