"""Many jobs on one key (limiter.lua through RedisLimiter) on a real Redis-protocol server: each
engine's own lease, leases that lapse, weighted max-min shares under saturation, slack lent by
an idle job and forgiven after a lull, no credit banked by give-backs."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

import pytest
import redis

from .test_limiter import _hammer, _hammer_until_killed, _limiter, run


def test_each_engine_releases_only_its_own_lease(redis_url, namespace):
    async def main():
        # A burst, so that no acquire waits on its job's own schedule (which moves the uses).
        kw = {"tpm": 60_000, "lease_ms": 2000, "burst_s": 0.5}
        client, a = _limiter(redis_url, namespace, job="shared-key", **kw)
        _, b = _limiter(redis_url, namespace, job="shared-key", **kw)
        _, other = _limiter(redis_url, namespace, job="other", **kw)
        await a.acquire(1)
        await b.acquire(1)
        assert (await other.acquire(1)).active_jobs == 2
        await a.release()  # one process of the job ends; the other one goes on
        grant = await other.acquire(1)
        assert grant.active_jobs == 2 and grant.share == pytest.approx(0.5)
        await b.release()
        assert (await other.acquire(1)).active_jobs == 1
        await other.release()
        assert await client.zcard(f"{namespace}:leases") == 0
        await client.aclose()

    run(main())


def test_leases_lapse(redis_url, namespace):
    async def main():
        client, a = _limiter(redis_url, namespace, job="a", tpm=60_000, lease_ms=300)
        _, b = _limiter(redis_url, namespace, job="b", tpm=60_000, lease_ms=300)
        await a.acquire(1)
        assert (await b.acquire(1)).active_jobs == 2
        await asyncio.sleep(0.4)  # a's lease lapses, as when its process dies
        assert (await b.acquire(1)).active_jobs == 1
        await client.aclose()

    run(main())


def test_a_job_killed_at_saturation_gives_its_share_back_when_its_lease_lapses(
    redis_url, namespace
):
    # A process SIGKILLed while it holds a lease, a weight and slots reserved ahead: nothing of
    # it runs again, no release is sent. The job beside it gets half the limit while it lives
    # and the whole of it once its lease lapses (its weight and use are forgotten then).
    settings = {"tpm": 300_000, "burst_s": 0.2, "lease_ms": 500}  # 5000 tokens/s
    ctx = mp.get_context("spawn")
    dying = ctx.Process(target=_hammer_until_killed, args=(redis_url, namespace, settings))
    dying.start()
    probe = redis.Redis.from_url(redis_url)
    try:
        deadline = time.time() + 60
        while not probe.zcard(f"{namespace}:leases") and time.time() < deadline:
            time.sleep(0.05)
        assert dying.is_alive() and probe.zcard(f"{namespace}:leases")

        async def main():
            async def kill_later():
                await asyncio.sleep(2.0)
                os.kill(dying.pid, signal.SIGKILL)
                return time.time()

            killer = asyncio.create_task(kill_later())
            sends = await _hammer(redis_url, namespace, 5.0, 16, settings, job="lives")
            return sends, await killer

        sends, killed = run(main())
        dying.join(timeout=10)
        # Nothing of the dead job is left: its lease lapsed, its weight and use went with it.
        assert not probe.exists(f"{namespace}:leases", f"{namespace}:jobs")
    finally:
        if dying.is_alive():
            dying.kill()
        probe.close()
    start = min(t for t, _ in sends)

    def rate(lo, hi):
        return sum(c for t, c in sends if lo <= t < hi) / (hi - lo)

    assert rate(start + 0.5, killed) <= 0.75 * 5000  # shared while the other job lives
    assert rate(killed + 0.5 + 0.5, start + 5.0) >= 0.85 * 5000  # whole once its lease lapsed


@pytest.mark.parametrize("reach_s", [3600.0, 1.0], ids=["slots-read-ahead", "within-reach"])
def test_weighted_shares_hold_under_saturation(redis_url, namespace, reach_s):
    # 5000 tokens/s, ~100 req/s. Within reach, a job ahead of its own schedule by more than the
    # reach reserves nothing there and asks again (its queue is not laid out at today's rate).
    settings = {"tpm": 300_000, "burst_s": 0.2, "reach_s": reach_s}

    async def main():
        return await asyncio.gather(
            _hammer(redis_url, namespace, 5.0, 16, settings, job="light", weight=1.0, seed=1),
            _hammer(redis_url, namespace, 5.0, 16, settings, job="heavy", weight=3.0, seed=2),
        )

    light, heavy = run(main())
    start = min(t for t, _ in light + heavy)
    lo, hi = start + 1.0, start + 5.0  # steady part

    def tokens(sends):
        return sum(c for t, c in sends if lo <= t < hi)

    ratio = tokens(heavy) / tokens(light)
    assert 1.8 < ratio < 4.2, ratio  # weights 1:3 (1 without them), on a busy host too
    # Work-conserving: together they still use (nearly) the whole limit.
    assert tokens(heavy) + tokens(light) >= 0.8 * 5000 * (hi - lo)


def test_an_idle_job_leaves_its_share_as_slack(redis_url, namespace):
    settings = {"tpm": 300_000, "burst_s": 0.2}

    async def main():
        client, idle = _limiter(redis_url, namespace, job="idle", **settings)
        await idle.acquire(1)  # holds a lease with weight 1, then sends almost nothing
        sends = await _hammer(redis_url, namespace, 3.0, 16, settings, job="busy")
        await client.aclose()
        return sends

    sends = run(main())
    start = min(t for t, _ in sends)
    used = sum(c for t, c in sends if start + 0.5 <= t < start + 3.0)
    assert used >= 0.75 * 5000 * 2.5  # far above the 50 % share the idle job would leave


def test_slots_given_back_while_alone_bank_nothing_against_a_later_job(redis_url, namespace):
    """Two jobs share the key for a while, then one's run ends; the other, alone, gives back 40
    slots (rows whose deadlines passed). When a second job comes again, the first has no credit
    to spend: under saturation they share one for one (the old limiter kept each give-back as
    a credit: 40 grants to none)."""
    settings = {"rpm": 600, "burst_s": 0.1}  # 10/s

    async def main():
        client, a = _limiter(redis_url, namespace, job="a", **settings)
        _, b = _limiter(redis_url, namespace, job="b", **settings)
        for _ in range(10):  # a spell of sharing, then b's run ends
            await a.acquire(0, deadline=time.monotonic())
            await b.acquire(0, deadline=time.monotonic())
        await b.release()
        await asyncio.sleep(1.5)
        for _ in range(40):
            await a.give_back(await a.acquire(0))
        got = {"a": 0, "b": 0}
        for _ in range(40):  # both ask as fast as they can; a deferral is not waited out
            for name, lim in (("a", a), ("b", b)):
                got[name] += (await lim.acquire(0, deadline=time.monotonic())).granted
        await client.aclose()
        return got

    got = run(main())
    assert got["a"] <= got["b"] + 6, got


def test_share_slack_used_in_a_lull_is_forgiven_beyond_a_second(redis_url, namespace):
    """Two jobs of weight 1 on a key with room to spare: `a` sends 0.83 of the limit, more than
    its half share, `b` enough not to count as idle. Nothing is saturated, so nothing holds `a`
    back, but its own schedule runs ahead of the clock at 1/share per request. When the key
    saturates, `a` is held to its share from there: without LULL_FORGIVE_MS its schedule is
    seconds ahead (every lull request it sent counted twice), and it would wait out all of it
    while `b` takes the key."""
    settings = {"tpm": 600_000}  # 10,000 tokens/s: 5,000 is half a second of the schedule

    async def main():
        client, a = _limiter(redis_url, namespace, job="a", **settings)
        _, b = _limiter(redis_url, namespace, job="b", **settings)
        for _ in range(8):  # the lull: each a's request ends before the next cycle starts
            await b.give_back(await b.acquire(2_500))  # b's use counts; the key keeps its room
            grant = await a.acquire(5_000, deadline=time.monotonic())
            assert grant.granted and grant.wait_s < 0.1, grant  # never saturated, never held
            await asyncio.sleep(0.6)
        await b.acquire(5_000)  # the key saturates: b's slot runs half a second ahead
        held = await a.acquire(5_000, deadline=time.monotonic())
        await client.aclose()
        return held

    held = run(main())
    # At most the second forgiven at its last lull request, less the 0.6 s since (0.4 s): not
    # the 3.2 s its schedule had run ahead over the lull.
    assert held.wait_s < 1.2, held
