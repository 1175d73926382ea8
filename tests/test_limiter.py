"""The Redis limiter on a real Redis-protocol server: exact limits, refunds, leases, shares."""

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
    client = aioredis.Redis.from_url(url)
    return client, RedisLimiter(
        client, namespace=namespace, settings=LimiterSettings(**settings), job=job, weight=weight
    )


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
    await client.aclose()
    return sends


def _process_main(url, namespace, seconds, settings, seed, queue):
    queue.put(asyncio.run(_hammer(url, namespace, seconds, 8, settings, job=f"p{seed}", seed=seed)))


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


def test_refund_and_charge_move_the_schedule(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=None, tpm=6000, burst_s=0.5)  # 100/s
        first = await lim.acquire(500)
        assert first.wait_s == 0
        before = await lim.acquire(10)
        assert 4.3 < before.wait_s < 4.6  # 500 tokens = 5 s, minus the 0.5 s burst
        await lim.reconcile(-400)  # the first answer used 400 tokens less than reserved
        after = await lim.acquire(10)
        assert 0.4 < after.wait_s < 0.8
        await lim.reconcile(+300)  # a charge pushes the schedule on by 3 s
        charged = await lim.acquire(10)
        assert 2.9 < charged.wait_s - after.wait_s < 3.3
        await client.aclose()

    asyncio.run(main())


def test_refund_never_moves_the_schedule_before_now(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=None, tpm=6000, burst_s=0.5)
        await lim.acquire(10)
        await lim.reconcile(-100_000)
        # A huge refund must not bank capacity: the burst is all that is available.
        waits = [(await lim.acquire(25)).wait_s for _ in range(4)]
        assert waits[0] == 0 and waits[1] == 0
        assert waits[3] > 0.1
        await client.aclose()

    asyncio.run(main())


def test_leases_lapse_and_are_released(redis_url, namespace):
    async def main():
        client, a = _limiter(redis_url, namespace, job="a", tpm=60_000, lease_ms=300)
        _, b = _limiter(redis_url, namespace, job="b", tpm=60_000, lease_ms=300)
        assert (await a.acquire(1)).active_jobs == 1
        grant = await b.acquire(1)
        assert grant.active_jobs == 2 and grant.share == pytest.approx(0.5)
        await asyncio.sleep(0.4)  # a's lease lapses, as when its process dies
        assert (await b.acquire(1)).active_jobs == 1
        await b.release()
        assert await client.zcard(f"{namespace}:leases") == 0
        await client.aclose()

    asyncio.run(main())


def test_weighted_shares_hold_under_saturation(redis_url, namespace):
    settings = {"rpm": None, "tpm": 300_000, "burst_s": 0.2}  # 5000 tokens/s, ~100 req/s

    async def main():
        return await asyncio.gather(
            _hammer(redis_url, namespace, 5.0, 16, settings, job="light", weight=1.0, seed=1),
            _hammer(redis_url, namespace, 5.0, 16, settings, job="heavy", weight=3.0, seed=2),
        )

    light, heavy = asyncio.run(main())
    start = min(t for t, _ in light + heavy)
    lo, hi = start + 1.0, start + 5.0  # steady part

    def tokens(sends):
        return sum(c for t, c in sends if lo <= t < hi)

    ratio = tokens(heavy) / tokens(light)
    assert 2.2 < ratio < 3.8, ratio  # weights 1:3, within the noise of a 4 s window
    # Work-conserving: together they still use (nearly) the whole limit.
    assert tokens(heavy) + tokens(light) >= 0.9 * 5000 * (hi - lo)


def test_weighted_shares_hold_while_the_rate_recovers(redis_url, namespace):
    """Jobs queue on their own schedules for seconds ahead (the lighter one longer): those
    reservations must come due by the bucket's capacity since, not by the rate of when they
    were made, or the lighter job falls behind while the rate recovers from a 429."""
    settings = {"rpm": 1200, "tpm": None, "burst_s": 0.2, "recovery_per_s": 0.15}

    async def main():
        client, lim = _limiter(redis_url, namespace, **settings)
        await lim.acquire(0)
        await lim.penalize(retry_after_s=None)  # 0.7 of the rate, back to full in ~2 s
        await client.aclose()
        return await asyncio.gather(
            _hammer(redis_url, namespace, 6.0, 16, settings, job="light", weight=1.0, seed=1),
            _hammer(redis_url, namespace, 6.0, 16, settings, job="heavy", weight=2.0, seed=2),
        )

    light, heavy = asyncio.run(main())
    start = min(t for t, _ in light + heavy)
    lo, hi = start + 1.5, start + 6.0  # the queues are built; the rate recovers within it

    def sends(job):
        return sum(1 for t, _ in job if lo <= t < hi)

    share = sends(light) / (sends(light) + sends(heavy))
    assert abs(share / (1 / 3) - 1) < 0.1, share


def test_a_refunded_request_keeps_its_jobs_place(redis_url, namespace):
    """A refund gives back the shared slot and leaves the job's own reservation as a credit:
    the request taken again goes next, instead of every refunded request landing on the same
    reserved time of its job (and all going at once)."""
    settings = {"rpm": 600, "tpm": None, "burst_s": 0.1}

    async def main():
        _, other = _limiter(redis_url, namespace, job="other", **settings)
        client, lim = _limiter(redis_url, namespace, job="job", **settings)
        await other.acquire(0)
        for _ in range(30):  # the other job keeps the bucket saturated and is not idle
            await other.acquire(0, deadline=time.monotonic())
        grants = [await lim.acquire(0, deadline=time.monotonic()) for _ in range(8)]
        deferred = [g for g in grants if not g.granted]
        assert deferred and all(g.share == pytest.approx(0.5) for g in grants)
        granted = [g for g in grants if g.granted]
        for _ in granted:
            await lim.reconcile(0, -1)
        again = [await lim.acquire(0, deadline=time.monotonic()) for _ in granted]
        assert all(g.granted for g in again)  # the credits, spent: no second reservation
        # ... and the job's own schedule did not move back: the next is deferred past the last.
        nxt = await lim.acquire(0, deadline=time.monotonic())
        assert not nxt.granted and nxt.wait_s > max(g.wait_s for g in deferred)
        await client.aclose()
        await other._redis.aclose()

    asyncio.run(main())


def test_idle_job_leaves_its_share_as_slack(redis_url, namespace):
    settings = {"rpm": None, "tpm": 300_000, "burst_s": 0.2}

    async def main():
        client, idle = _limiter(redis_url, namespace, job="idle", **settings)
        await idle.acquire(1)  # holds a lease with weight 1, then sends almost nothing
        sends = await _hammer(redis_url, namespace, 3.0, 16, settings, job="busy")
        await client.aclose()
        return sends

    sends = asyncio.run(main())
    start = min(t for t, _ in sends)
    used = sum(c for t, c in sends if start + 0.5 <= t < start + 3.0)
    assert used >= 0.85 * 5000 * 2.5  # far above the 50 % share the idle job would leave


def test_429_slows_the_bucket_and_pauses_for_the_hint(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600, tpm=None, burst_s=0.1)
        await lim.acquire(0)
        factor = await lim.penalize(retry_after_s=0.8)
        assert factor == pytest.approx(0.7, abs=0.01)
        grant = await lim.acquire(0)
        assert grant.wait_s >= 0.75  # everyone waits out the server's hint
        assert grant.factor < 0.8
        # A second 429 within the cooldown does not compound the slow-down.
        assert await lim.penalize(retry_after_s=None) > 0.65
        await client.aclose()

    asyncio.run(main())


def test_keys_are_namespaced_without_the_api_key(redis_url):
    secret = "sk-live-do-not-store-1234567890"
    ns = limiter_namespace("https://api.openai.com/v1", "gpt-4o-mini", secret)
    assert secret not in ns and "gpt-4o-mini" in ns
    assert ns != limiter_namespace("https://api.openai.com/v1", "gpt-4o-mini", secret + "x")
    assert ns != limiter_namespace("http://localhost:8000/v1", "gpt-4o-mini", secret)

    async def main():
        client, lim = _limiter(redis_url, ns, rpm=60, tpm=1000)
        await lim.acquire(10)
        await client.aclose()

    asyncio.run(main())
    r = redis.Redis.from_url(redis_url)
    keys = [k.decode() for k in r.keys(ns.replace("{", "\\{").replace("}", "\\}") + "*")]
    assert keys and all(secret not in k for k in keys)
    assert all(r.pttl(k) > 0 for k in keys)  # nothing lives forever


def test_time_stepping_back_neither_stops_nor_runs_the_limiter_ahead(redis_url, namespace):
    """A failover to a server whose clock is an hour behind: stored times are an hour ahead."""

    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600, tpm=None, burst_s=0.5)
        await lim.acquire(0)
        await lim.penalize(retry_after_s=None)
        key = f"{namespace}:state"
        hour = 3_600_000
        st = {k.decode(): float(v) for k, v in (await client.hgetall(key)).items() if k != b"se"}
        shifted = {k: st[k] + hour for k in ("tr", "ft", "dec", "ts")}
        await client.hset(key, mapping=shifted)
        grant = await lim.acquire(0)
        assert grant.wait_s < 1.0  # not an hour
        assert 0.1 <= grant.factor <= 1.0  # never negative (a negative factor turned it off)
        # Still limiting: 10 requests/s with a 0.5 s burst, so the 20th waits about 1.4 s.
        waits = [(await lim.acquire(0)).wait_s for _ in range(20)]
        assert 0.8 < waits[-1] < 4.0
        await client.aclose()

    asyncio.run(main())


def test_a_server_that_lost_its_data_does_not_hand_out_slots_already_held(redis_url, namespace):
    """A restart without persistence (or a failover to an empty replica) while this process
    holds slots seconds ahead: the fresh state starts after them, not with a full bucket now
    (those sends and a whole new burst would go together)."""

    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600, tpm=None, burst_s=0.5)
        waits = [(await lim.acquire(0)).wait_s for _ in range(30)]
        assert waits[-1] > 2.0  # 10 requests/s: the 30th is held about 2.4 s ahead
        await client.delete(f"{namespace}:state")  # the server lost its data
        grant = await lim.acquire(0)
        # After every slot held (less the time the acquires took), not at once.
        assert grant.wait_s >= waits[-1] - 0.5, (grant.wait_s, waits[-1])
        await client.aclose()

    asyncio.run(main())


def test_slots_moved_for_a_wider_burst_keep_their_order_and_the_schedule(redis_url, namespace):
    """The provider's headers widen the burst from 0.5 s to 2 s while 15 requests sleep on
    slots granted under the narrower one: moved in one call, they go as early as the wider
    burst lets them, in their order, and the schedule's end (what later requests get) is
    where it was: nothing counted twice, nothing lost."""

    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600, tpm=60_000, burst_s=0.5)
        grants = [await lim.acquire(100) for _ in range(20)]
        held = [g for g in grants if g.wait_s > 0]
        assert len(held) >= 14 and held[-1].wait_s > 1.0  # 10/s after a burst of 0.5 s
        key = f"{namespace}:state"
        before = {k: float(await client.hget(key, k)) for k in ("tr", "tt")}
        await client.hset(key, "lb", 2000)  # what an observe of a 2 s bucket learns
        moved = await lim.reslot(held, [100] * len(held))
        after = {k: float(await client.hget(key, k)) for k in ("tr", "tt")}
        assert after == pytest.approx(before, abs=1)
        slots = [g.slot_ms for g in moved]
        assert slots == sorted(slots)
        # 20 requests fit in a 2 s burst at 10/s: every one may go now (the calls took ms).
        assert all(g.wait_s < 0.3 for g in moved), [g.wait_s for g in moved]
        assert all(new.slot_ms <= old.slot_ms for new, old in zip(moved, held, strict=True))
        await client.aclose()

    asyncio.run(main())


def test_slots_moved_after_the_rate_fell_do_not_give_back_what_was_sent(redis_url, namespace):
    """The first answers lowered the limit (x-ratelimit-limit) and widened the burst. The
    sleepers' slots, given back at the lower rate, would free more than they took at the higher
    one, and the schedule would forget the requests already sent (one 429 and 0.91 of the
    limit in the matrix's bucket1s/rpm/1.2 cell): the schedule restarts no earlier than where
    it was before the first sleeper."""

    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600, tpm=None, burst_s=0.5)
        held = [g for g in [await lim.acquire(0) for _ in range(20)] if g.wait_s > 0]
        lim.rpm = 300  # what lower_limits does with the provider's figure
        await client.hset(f"{namespace}:state", "lb", 2000)
        await lim.reslot(held, [0] * len(held))
        tr = float(await client.hget(f"{namespace}:state", "tr"))
        before_first = held[0].slot_ms + held[0].burst_ms
        assert held[0].burst_ms == 500
        # Every sleeper again, 200 ms apart at 5/s, after the schedule's end before them.
        assert tr >= before_first + len(held) * 200 - 2, (tr - before_first, len(held))
        await client.aclose()

    asyncio.run(main())


def test_a_factor_stored_out_of_range_is_clamped(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600, tpm=None, min_factor=0.1)
        await lim.acquire(0)
        # Stored just now, so the rate's recovery since cannot bring it back into range.
        sec, usec = await client.time()
        now_ms = sec * 1000 + usec / 1000
        await client.hset(f"{namespace}:state", mapping={"f": -3, "ft": now_ms})
        assert (await lim.acquire(0)).factor >= 0.1
        await client.hset(f"{namespace}:state", mapping={"f": 7, "ft": now_ms})
        assert (await lim.acquire(0)).factor <= 1.0
        await client.aclose()

    asyncio.run(main())


def test_one_overload_event_is_one_decrease(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600, tpm=None, cooldown_ms=0)
        early = [await lim.acquire(0) for _ in range(5)]  # granted before the first 429
        first = await lim.penalize(retry_after_s=None, slot_ms=early[0].slot_ms)
        assert first == pytest.approx(0.7, abs=0.01)
        for g in early[1:]:  # their 429s arrive later: the same event
            assert await lim.penalize(retry_after_s=None, slot_ms=g.slot_ms) > 0.65
        await asyncio.sleep(0.05)
        late = await lim.acquire(0)  # granted after the decrease: a new event
        assert await lim.penalize(retry_after_s=None, slot_ms=late.slot_ms) < 0.5
        await client.aclose()

    asyncio.run(main())


def test_after_a_pause_held_and_new_requests_go_out_paced(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=1200, tpm=None, burst_s=0.5)
        await lim.acquire(0)
        await lim.penalize(retry_after_s=0.5)
        waits = sorted([(await lim.acquire(0)).wait_s for _ in range(10)])
        assert waits[0] >= 0.45  # nobody before the pause ends
        # ... and then at the (slowed) rate, not all at once: 20/s x 0.7 = 14/s.
        gaps = [b - a for a, b in itertools.pairwise(waits)]
        assert min(gaps) > 0.05 and waits[-1] - waits[0] > 0.5
        await client.aclose()

    asyncio.run(main())


def test_slots_given_back_after_a_429_are_taken_again_paced(redis_url, namespace):
    # 20 requests hold slots granted at the old rate; a 429 pauses everyone. The engine gives
    # those slots back and takes fresh ones: the refunds must not refill the emptied burst
    # (then the fresh slots would all be at the pause's end, the herd of issue 10).
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=1200, tpm=None, burst_s=0.5)
        held = [await lim.acquire(0) for _ in range(20)]
        await lim.penalize(retry_after_s=0.3, slot_ms=held[-1].slot_ms)
        for _ in held:
            await lim.reconcile(0, -1)
        waits = sorted([(await lim.acquire(0)).wait_s for _ in range(10)])
        assert waits[0] >= 0.25  # nobody before the pause ends
        gaps = [b - a for a, b in itertools.pairwise(waits)]
        assert min(gaps) > 0.05, waits  # 20/s x 0.7 = 14/s: one every ~71 ms
        await client.aclose()

    asyncio.run(main())


def test_a_long_server_hint_pauses_everyone_for_a_minute_at_most(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600, tpm=None)
        await lim.acquire(0)
        await lim.penalize(retry_after_s=3600)
        grant = await lim.acquire(0)
        assert 50 < grant.wait_s <= 61
        await client.aclose()

    asyncio.run(main())


def test_the_providers_remaining_caps_what_is_promised(redis_url, namespace):
    from batch_llm_assets.engine.usage import ProviderLimits

    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=None, tpm=60_000, burst_s=0.5)
        assert (await lim.acquire(400)).wait_s == 0  # the burst holds 500
        await lim.observe(ProviderLimits(remaining_tokens=0, reset_tokens_s=0.5))
        # The provider says nothing remains: the burst left here (100) is not promised; as in
        # any GCRA, one request may cross the line, the next waits for the refill.
        await lim.acquire(50)
        assert (await lim.acquire(50)).wait_s > 0.04
        await client.aclose()

    asyncio.run(main())


def test_the_burst_grows_to_the_providers_bucket_and_shrinks_on_a_429(redis_url, namespace):
    from batch_llm_assets.engine.usage import ProviderLimits

    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=None, tpm=60_000, burst_s=0.5)
        # A minute-long bucket, nearly full: 59k remain, 1 s to refill the rest.
        await lim.observe(ProviderLimits(remaining_tokens=59_000, reset_tokens_s=1.0))
        waits = [(await lim.acquire(1000)).wait_s for _ in range(40)]
        assert max(waits) == 0  # 40k tokens at once (the configured burst is 500)
        await lim.penalize(retry_after_s=None)
        # Back to paced from now (not a minute of schedule to wait out): one request at once,
        # the next after its emission interval at the slowed rate (1000 / 700 per s).
        assert (await lim.acquire(1000)).wait_s == 0
        assert 1.0 < (await lim.acquire(1000)).wait_s < 2.0
        await client.aclose()

    asyncio.run(main())


def test_an_answer_seen_late_is_credited_the_refill_since_its_snapshot(redis_url, namespace):
    # The provider took its snapshot when the request arrived; the answer came back later, and
    # its observe can wait for a connection for tenths of a second while a burst's answers come
    # in. The bucket refilled meanwhile: the clamp runs from the snapshot (in Redis's clock,
    # learnt from the replies), not from when the script runs. Aged from the script, a minute's
    # bucket was held 1-2 s short in the matrix's first bursts. For an engine alone on the key.
    from batch_llm_assets.engine.usage import ProviderLimits

    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=None, tpm=60_000, burst_s=0.5)
        assert (await lim.acquire(0)).wait_s == 0  # a reply: Redis's clock is learnt
        empty = ProviderLimits(remaining_tokens=0, reset_tokens_s=0.5)
        await lim.observe(empty, sent_at=time.monotonic() - 0.3)  # went 300 ms ago
        # 300 tokens have refilled since: two requests of 250 go now (one may cross the
        # line, as in any GCRA), the third waits for the rest.
        waits = [(await lim.acquire(250)).wait_s for _ in range(3)]
        assert waits[0] == 0 and waits[1] < 0.05, waits
        assert 0.1 < waits[2] < 0.35, waits
        await client.aclose()
        # Without the send's time, the snapshot counts as taken now: the second one waits.
        client, lim = _limiter(redis_url, namespace + "b", rpm=None, tpm=60_000, burst_s=0.5)
        await lim.acquire(0)
        await lim.observe(empty)
        waits = [(await lim.acquire(250)).wait_s for _ in range(2)]
        assert waits[1] > 0.2, waits
        await client.aclose()
        # Nor with another engine on the key: its sends since the snapshot are not in the
        # remaining this one reports, and at their rate they about take the refill.
        client, lim = _limiter(redis_url, namespace + "c", rpm=None, tpm=60_000, burst_s=0.5)
        client2, other = _limiter(redis_url, namespace + "c", rpm=None, tpm=60_000, burst_s=0.5)
        await lim.acquire(0)
        await other.acquire(0)
        await lim.observe(empty, sent_at=time.monotonic() - 0.3)
        waits = [(await lim.acquire(250)).wait_s for _ in range(2)]
        assert waits[1] > 0.2, waits
        await client.aclose()
        await client2.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("bucket_s", [10, 1])
def test_an_engine_alone_on_the_key_bursts_closer_to_the_providers_bucket(
    redis_url, namespace, bucket_s
):
    # A full bucket at 1000 tokens/s. The margin below it is a tenth (at least the configured
    # 0.5 s) for engines that share the key; an engine alone whose token counts have settled
    # holds its own sends against the provider's headers, so 50 ms will do: on a 1 s bucket
    # too (OpenAI's per-second enforcement), which used to keep the half second.
    from batch_llm_assets.engine.usage import ProviderLimits

    full = ProviderLimits(remaining_tokens=1000 * bucket_s, reset_tokens_s=0.0)
    shared, alone = bucket_s - max(0.5, 0.1 * bucket_s), bucket_s - 0.05

    async def main():
        client, one = _limiter(redis_url, namespace, rpm=None, tpm=60_000, burst_s=0.5)
        assert await one.observe(full) == pytest.approx(shared, abs=0.01)  # not settled yet
        one.settled = True
        assert await one.observe(full) == pytest.approx(alone, abs=0.01)
        # An observe whose arguments were built before the flag was set (it queued for a
        # connection) does not take the margin back: the burst flipped between 9 and 9.95 s,
        # and each widening woke every sleeper to take a fresh slot.
        one.settled = False
        assert await one.observe(full) == pytest.approx(alone, abs=0.01)
        # A second engine (another process) starts on the key: the margin is back.
        client2, two = _limiter(redis_url, namespace, rpm=None, tpm=60_000, burst_s=0.5)
        await two.acquire(10)
        assert await one.observe(full) == pytest.approx(shared, abs=0.01)
        await two.release()  # it ends: alone again
        assert await one.observe(full) == pytest.approx(alone, abs=0.01)
        await client.aclose()
        await client2.aclose()

    asyncio.run(main())


def test_the_next_engine_on_the_key_starts_from_the_margin_of_one_not_settled(redis_url, namespace):
    # One run alone on the key learnt its burst with the 50 ms margin; the next partition's run
    # (another engine, its gate not calibrated yet) started its first burst from it and met
    # the provider's bucket edge: a 429 in 5 of 10 such partitions of `make demo`.
    from batch_llm_assets.engine.usage import ProviderLimits

    full = ProviderLimits(remaining_tokens=10_000, reset_tokens_s=0.0)  # 10 s at 1000 tokens/s

    async def immediate(lim) -> int:
        n = 0
        while (await lim.acquire(100)).wait_s == 0 and n < 200:
            n += 1
        return n

    async def main():
        client, one = _limiter(redis_url, namespace, rpm=None, tpm=60_000, burst_s=0.5)
        one.settled = True
        assert await one.observe(full) == pytest.approx(9.95, abs=0.01)
        await one.release()
        await client.aclose()
        client, two = _limiter(redis_url, namespace, rpm=None, tpm=60_000, burst_s=0.5)
        sent = await immediate(two)
        await client.aclose()
        # 9 s of the bucket (a tenth held back), not 9.95 s: 91 requests of 100 at once.
        assert sent <= 92, sent
        # The engine that learnt it keeps its own margin.
        client, three = _limiter(redis_url, namespace + "b", rpm=None, tpm=60_000, burst_s=0.5)
        three.settled = True
        await three.observe(full)
        assert await immediate(three) >= 99
        await client.aclose()

    asyncio.run(main())


def test_a_burst_widened_by_an_answer_is_held_to_what_the_answer_says_remains(redis_url, namespace):
    # 1000 tokens/s, a 1 s bucket. 500 tokens went at once (the configured burst); the
    # provider counted 700 of them (it counts otherwise) and says 300 remain. The answer widens
    # the burst to 950 ms, and the clamp is for that burst: 300 tokens may go now, less the 50 ms
    # an engine alone keeps from the provider's bucket (one request may cross the line, as in
    # any GCRA). Held to the half-second burst it came before, the clamp let 500 go: a 429.
    from batch_llm_assets.engine.usage import ProviderLimits

    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=None, tpm=60_000, burst_s=0.5)
        lim.settled = True
        assert [(await lim.acquire(100)).wait_s for _ in range(5)] == [0.0] * 5
        told = ProviderLimits(remaining_tokens=300, reset_tokens_s=0.7)
        assert await lim.observe(told) == pytest.approx(0.95, abs=0.005)
        at_once = 0
        while (await lim.acquire(100)).wait_s == 0:
            at_once += 1
        assert 2 <= at_once <= 3
        await client.aclose()

    asyncio.run(main())


def test_more_in_flight_than_remains_is_a_debt_the_schedule_holds(redis_url, namespace):
    # The engine's remaining is the answer's less what it sent since: with more in flight than
    # the provider showed left, it is below zero. Read as "unknown" (or floored at zero), the
    # clamp lost the excess exactly at the bucket's edge.
    from batch_llm_assets.engine.usage import ProviderLimits

    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=None, tpm=60_000, burst_s=0.5)
        owed = ProviderLimits(remaining_tokens=-200, reset_tokens_s=1.2)  # a 1 s bucket
        await lim.observe(owed)
        assert (await lim.acquire(10)).wait_s == pytest.approx(0.2, abs=0.02)
        await client.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("limit_tokens", "decrease"),
    [(60_000, 0.9), (50_000, 0.9), (None, 0.7), (2_000, 0.7)],
    ids=["stated", "stated-lower", "not-stated", "a-capacity"],
)
def test_a_429_at_a_rate_the_provider_states_costs_a_milder_decrease(
    redis_url, namespace, limit_tokens, decrease
):
    # The provider's x-ratelimit-limit says the rate the limiter paces at is its own: an
    # isolated 429 came at its bucket's edge (a send's jitter, a count a little off), not from a rate too
    # high, and x0.7 cost a 3 s job a tenth of its time while the rate climbed back. Without
    # the figure, or with one that is a bucket's capacity, the rate may be wrong: x0.7.
    from batch_llm_assets.engine.usage import ProviderLimits

    async def main():
        client, lim = _limiter(
            redis_url, namespace, rpm=None, tpm=60_000, burst_s=0.5, cooldown_ms=50
        )
        answer = ProviderLimits(limit_tokens=limit_tokens, remaining_tokens=1000, reset_tokens_s=0)
        await lim.observe(answer)
        first = await lim.penalize(retry_after_s=None)
        assert first == pytest.approx(decrease, abs=0.01)
        # Another overload event within 10 s is a pattern, whatever the provider states: x0.7.
        await asyncio.sleep(0.1)
        assert await lim.penalize(retry_after_s=None) == pytest.approx(first * 0.7, abs=0.01)
        await client.aclose()

    asyncio.run(main())


def test_a_remaining_a_little_low_does_not_hold_the_schedule_short(redis_url, namespace):
    # The remaining an engine reports is the answer's less its own sends since; an answer
    # overtaken in flight makes it low by a request or two at times, and the clamp only ever
    # ratchets the schedule up. For an engine alone on the key, 2 % of a 60 s bucket (1.2 s)
    # is let go: its provider gate holds the exact remaining. With two engines, it is not.
    from batch_llm_assets.engine.usage import ProviderLimits

    full = ProviderLimits(remaining_tokens=60_000, reset_tokens_s=0.0)
    low = ProviderLimits(remaining_tokens=4_000, reset_tokens_s=56.0)

    async def at_once(lim, tokens, n):
        return sum([(await lim.acquire(tokens)).wait_s == 0 for _ in range(n)])

    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=None, tpm=60_000, burst_s=0.5)
        lim.settled = True
        assert await lim.observe(full) == pytest.approx(59.95, abs=0.01)
        assert await at_once(lim, 1000, 55) == 55
        # The schedule has ~4.95 s left; the provider (seen late) says 4.0 s.
        await lim.observe(low)
        assert await at_once(lim, 250, 24) >= 19  # 4.95 s / 0.25 (16 if clamped to 4.0)
        await client.aclose()

        # The same with a second engine on the key: the clamp is exact (and the margin 6 s).
        await asyncio.sleep(0)
        client, lim = _limiter(redis_url, namespace + "2", rpm=None, tpm=60_000, burst_s=0.5)
        client2, two = _limiter(redis_url, namespace + "2", rpm=None, tpm=60_000, burst_s=0.5)
        lim.settled = True
        await two.acquire(0)
        assert await lim.observe(full) == pytest.approx(54.0, abs=0.01)
        assert await at_once(lim, 1000, 50) == 50
        await lim.observe(ProviderLimits(remaining_tokens=3_000, reset_tokens_s=57.0))
        assert await at_once(lim, 250, 24) <= 13  # 3.0 s / 0.25 = 12, and the refill meanwhile
        await client.aclose()
        await client2.aclose()

    asyncio.run(main())


def test_a_send_the_providers_count_already_covers_is_not_reconciled_twice(redis_url, namespace):
    # Three sends reserved at 100 tokens each; the provider counts 130 (characters/4 of the
    # body, say). The third's answer comes first, and the schedule is raised to the remaining
    # it shows: the provider's count of all three. The first two's reconciles (+30 each) came
    # after it and counted their error a second time: in a job's first burst a third of its
    # tokens, 0.1-0.3 s of a matrix cell on a 10 s bucket. For the only engine on the key.
    from batch_llm_assets.engine.engine import Engine, EngineSettings
    from batch_llm_assets.engine.transport import AiohttpTransport, ChatResponse
    from batch_llm_assets.engine.usage import ProviderLimits, Usage

    def answer(remaining: int) -> ChatResponse:
        # Never sent: the answers are fed back as the engine does when they arrive.
        headers = {"x-ratelimit-remaining-tokens": str(remaining), "x-ratelimit-reset-tokens": "1s"}
        usage = Usage(prompt_tokens=110, completion_tokens=5)
        return ChatResponse("ok", "stop", 110, 5, headers, usage=usage)

    async def state_tt(client) -> float:
        return float(await client.hget(f"{namespace}:state", "tt"))

    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=None, tpm=60_000, burst_s=0.5)
        transport = AiohttpTransport(base_url="http://127.0.0.1:9", api_key="", model="m")
        engine = Engine(EngineSettings(model="gpt-4o-mini"), transport, lim)
        sent_at = time.monotonic()
        for _ in range(3):
            await lim.acquire(100)
        engine._sent = [300, 3]
        limits = ProviderLimits(remaining_tokens=500 - 3 * 130, reset_tokens_s=0.39)
        await engine._after_answer(100, 100, 20, answer(110), limits, (300, 3), sent_at)
        assert lim.clamped_tokens and lim.only_engine
        raised = await state_tt(client)
        # Older snapshots of the same bucket of 500 tokens (no wider burst to learn).
        for seen, remaining in (((100, 1), 370), ((200, 2), 240)):
            limits = ProviderLimits(
                remaining_tokens=remaining, reset_tokens_s=(500 - remaining) / 1000
            )
            await engine._after_answer(100, 100, 20, answer(remaining), limits, seen, sent_at)
        assert await state_tt(client) == pytest.approx(raised, abs=1.0)  # ms: not +60
        await transport.aclose()
        await client.aclose()

    asyncio.run(main())
