"""A 429 on the shared limiter (limiter.lua through RedisLimiter) on a real Redis-protocol
server: one decrease per overload event, a capped shared pause, and the factor's recovery
(fast to under the rate that failed, slowly across it, fast again past it)."""

from __future__ import annotations

import itertools

import pytest

from batch_llm_assets.engine import _constants as C

from .test_limiter import _limiter, run


def test_a_429_restarts_the_schedule_once_per_overload_event(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=1200, burst_s=0.5)  # 20/s
        held = [await lim.acquire(0) for _ in range(20)]  # slots up to ~0.5 s ahead
        await lim.penalize(held[0], retry_after_s=0.5)
        cut = C.ADAPT_DECREASE
        assert lim.factor == pytest.approx(cut, abs=0.01) and lim.epoch == held[0].epoch + 1
        for g in held[1:]:  # their 429s come later: the same event, no further decrease
            await lim.penalize(g, retry_after_s=0.5)
        assert lim.factor == pytest.approx(cut, abs=0.01)
        # The old slots are stale (their epoch); what is granted now starts at the pause's
        # end and goes out paced at the slower rate (20/s x the cut), no burst.
        fresh = [await lim.acquire(0, give_back=g) for g in held[:10]]
        assert fresh[0].wait_s >= 0.45
        # Slots in Redis time: each wait_s is counted from its own acquire, a few ms apart.
        gaps = [b.slot_ms - a.slot_ms for a, b in itertools.pairwise(fresh)]
        assert min(gaps) > 0.95 * 50 / cut, gaps
        # Granted after the decrease, before any answer at the cut rate succeeded: the
        # provider still remembers the overload (a window until its end), the same event.
        late = await lim.acquire(0)
        await lim.penalize(late, retry_after_s=None)
        assert lim.factor == pytest.approx(cut, abs=0.01)
        # Once an answer at the cut rate succeeded, a 429 is a new event: one more decrease.
        await lim.settle(fresh[-1], ok=True)
        await lim.penalize(await lim.acquire(0), retry_after_s=None)
        assert lim.factor == pytest.approx(cut * cut, abs=0.01)
        await client.aclose()

    run(main())


def test_a_long_server_hint_pauses_everyone_for_a_minute_at_most(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600)
        grant = await lim.acquire(0)
        await lim.penalize(grant, retry_after_s=3600)
        assert 55 < (await lim.acquire(0)).wait_s <= 61
        await client.aclose()

    run(main())


def test_the_factor_recovers_fast_only_to_under_the_rate_that_failed(redis_url, namespace):
    # A 429 at the full rate: that rate was refused (no header says where the limit is). The
    # factor recovers at ADAPT_RECOVERY_PER_S only up to ADAPT_KNEE of it, then
    # ADAPT_PROBE_SLOWDOWN times slower; straight back to the rate that failed, it is refused
    # again once per cycle. Time passes by moving the state's clock back: 0.7 + 2.5 s x 0.1 =
    # 0.95 after 2.5 s, then 0.0025 a second.
    cut, knee, rec = C.ADAPT_DECREASE, C.ADAPT_KNEE, C.ADAPT_RECOVERY_PER_S
    fast_s = (knee - cut) / rec
    expected = knee + rec / C.ADAPT_PROBE_SLOWDOWN * (6 - fast_s)
    assert run(_factor_after(redis_url, namespace, events=1, later_s=6)) == pytest.approx(
        expected, abs=0.005
    )


async def _factor_after(url, namespace, *, events: int, later_s: float) -> float:
    """The factor `later_s` after `events` overload events in a row (each 429 for a grant made
    after an answer succeeded at the previous cut), time passed by moving the state's clock
    back."""
    client, lim = _limiter(url, namespace, rpm=600)
    for _ in range(events):
        await lim.settle(await lim.acquire(0), ok=True)
        await lim.penalize(await lim.acquire(0), retry_after_s=None)
    assert lim.factor == pytest.approx(C.ADAPT_DECREASE**events, abs=0.005)
    state = await client.hgetall(f"{namespace}:state")
    ft = float(state[b"ft"]) - later_s * 1000
    await client.hset(f"{namespace}:state", mapping={"ft": ft})
    factor = (await lim.acquire(0)).factor
    await client.aclose()
    return factor


def test_past_the_rate_that_failed_the_factor_recovers_fast_again(redis_url, namespace):
    # Two overload events: the second 429 came at the cut factor. Back across it, the factor is
    # at a rate the provider never refused (the limit rose: another client on the key stopped)
    # and goes on at ADAPT_RECOVERY_PER_S, not ADAPT_PROBE_SLOWDOWN times slower.
    cut, knee, rec, slow = (
        C.ADAPT_DECREASE,
        C.ADAPT_KNEE,
        C.ADAPT_RECOVERY_PER_S,
        C.ADAPT_PROBE_SLOWDOWN,
    )
    fast_s = (knee * cut - cut * cut) / rec
    across_s = (1 - knee) * cut * slow / rec
    beyond_s = 2.0
    later_s = fast_s + across_s + beyond_s
    factor = run(_factor_after(redis_url, namespace, events=2, later_s=later_s))
    assert factor == pytest.approx(cut + rec * beyond_s, abs=0.005)


def test_a_factor_stored_out_of_range_is_clamped(redis_url, namespace):
    async def main():
        client, lim = _limiter(redis_url, namespace, rpm=600)
        await lim.acquire(0)
        sec, usec = await client.time()
        now_ms = sec * 1000 + usec / 1000
        await client.hset(f"{namespace}:state", mapping={"f": -3, "ft": now_ms})
        assert (await lim.acquire(0)).factor >= 0.1
        await client.hset(f"{namespace}:state", mapping={"f": 7, "ft": now_ms})
        assert (await lim.acquire(0)).factor <= 1.0
        await client.aclose()

    run(main())
