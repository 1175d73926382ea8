"""The provider's rate-limit headers: durations and header values parsed, the controller reading
a limit header as per-minute or as a capacity, the remaining an answer shows less what was sent
since (at the provider's own count), the burst learned from a bucket; and engine runs against the
simulator over real HTTP and a real Valkey that honour them (a minute's bucket, a capacity sent
as the limit, a limit configured too high, a whole-second Retry-After, a provider that counts
tokens otherwise)."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from batch_llm_assets import ChatRequest
from batch_llm_assets.engine.limiter import LimiterSettings, RedisLimiter

from .test_engine_v2 import make, run_engine, state, user

pytestmark = pytest.mark.usefixtures("fresh_limiter_state")


# -- parsing the headers (no server needed) -----------------------------------------------------


def test_openai_durations_and_plain_seconds_are_read():
    from batch_llm_assets.engine.usage import parse_duration

    assert parse_duration("6m0s") == 360
    assert parse_duration("1.5s") == 1.5
    assert parse_duration("12ms") == pytest.approx(0.012)
    assert parse_duration("1m1.25s") == 61.25
    assert parse_duration("0.5") == 0.5 and parse_duration("2") == 2
    assert parse_duration("soon") is None and parse_duration(None) is None


def test_rate_limit_headers_that_are_not_numbers_a_provider_could_mean_are_ignored():
    # A header of infinity raised OverflowError out of the answer's feedback; an infinite reset
    # would have held a window's grants forever; a negative count is no count (a negative reset
    # stays 0: a rounding of "now").
    from batch_llm_assets.engine.usage import ProviderLimits, parse_limits

    for bad in ("inf", "-inf", "nan", "1e400", "-5", "\ud800", "soon"):
        counts = {f"x-ratelimit-{k}-{d}": bad for k in ("limit", "remaining") for d in DIMS}
        assert parse_limits(counts) == ProviderLimits(), bad
    for bad in ("inf", "nan", "1e400", "9" * 400 + "s", "\ud800", "soon"):
        resets = {f"x-ratelimit-reset-{d}": bad for d in DIMS}
        assert parse_limits(resets) == ProviderLimits(), bad


DIMS = ("requests", "tokens")


def test_a_gateways_generic_headers_are_read_as_the_requests_remaining_and_reset():
    # Kong and Dev Proxy send the IETF draft's RateLimit-*, its later drafts one structured
    # RateLimit field, Envoy's rate-limit filter X-RateLimit-*. Their limit is a quota per the
    # gateway's window, not per minute: not read. OpenAI's own headers come first.
    from batch_llm_assets.engine.usage import ProviderLimits, parse_limits

    want = ProviderLimits(remaining_requests=7, reset_requests_s=3.0)
    for headers in (
        {"ratelimit-limit": "50", "ratelimit-remaining": "7", "ratelimit-reset": "3"},
        {"ratelimit": '"hour";r=900;t=1800, "burst";r=7;t=3', "ratelimit-policy": '"b";q=50;w=5'},
        {"x-ratelimit-limit": "50", "x-ratelimit-remaining": "7", "x-ratelimit-reset": "3"},
    ):
        assert parse_limits(headers) == want, headers
    openai = {"x-ratelimit-remaining-requests": "9", "ratelimit-remaining": "7"}
    assert parse_limits(openai).remaining_requests == 9
    # A reset over a minute may be a Unix time (GitHub's), milliseconds, an hour's window: not
    # held on; a date does not parse. The remaining count stands without a reset.
    assert parse_limits({"x-ratelimit-remaining": "7", "x-ratelimit-reset": "60"}).reset_requests_s
    for reset in ("1764331200", "5000", "Sat, 28 Nov 2026 12:00:00 GMT", "nan", "\ud800"):
        got = parse_limits({"x-ratelimit-remaining": "7", "x-ratelimit-reset": reset})
        assert got == ProviderLimits(remaining_requests=7), reset
    for bad in ("-1", "inf", "many"):
        assert parse_limits({"ratelimit-remaining": bad}) == ProviderLimits(), bad
    huge = {"ratelimit": '"a";r=' + "9" * 5000 + ";t=1, " * 1000}  # over int()'s digit limit
    assert parse_limits(huge) == ProviderLimits(reset_requests_s=1.0)


# -- the controller reading them (no server needed) ----------------------------------------------


def test_a_limit_header_is_read_as_per_minute_or_as_a_capacity():
    from batch_llm_assets.engine.controller import Controller
    from batch_llm_assets.engine.usage import ProviderLimits

    lim = RedisLimiter(
        aioredis.Redis(), namespace="t:{x}", settings=LimiterSettings(rpm=1200, tpm=60_000)
    )
    ctl = Controller(lim)
    mark = ctl.on_send(60, 40)
    # OpenAI: a per-minute figure below the configured one is believed, and restarts.
    assert ctl.observe(ProviderLimits(limit_tokens=50_000, remaining_tokens=49_000), mark) == {
        "restart": 1,
        "rem_t": 49_000,
    }
    assert lim.tpm == 50_000
    # A 1 s bucket's capacity (1000) sent as the limit is not a rate: no cut to 1000/min.
    ctl.observe(ProviderLimits(limit_requests=20, remaining_requests=19), mark)
    assert lim.rpm == 1200
    # A figure above the configured limit never raises it: the configured one is a ceiling.
    ctl.observe(ProviderLimits(limit_tokens=90_000, remaining_tokens=89_000), mark)
    assert lim.tpm == 60_000


def test_what_was_sent_after_a_request_comes_off_the_remaining_its_answer_shows():
    from batch_llm_assets.engine.controller import Controller
    from batch_llm_assets.engine.usage import ProviderLimits

    lim = RedisLimiter(
        aioredis.Redis(), namespace="t:{x}", settings=LimiterSettings(rpm=1200, tpm=60_000)
    )
    ctl = Controller(lim)
    for d in ctl._dims:
        d.bucket = True  # as earlier answers showed (test_provider_shapes.py)
    mark = ctl.on_send(60, 40)
    for _ in range(4):
        ctl.on_send(35, 40)  # four more went before the first one's answer came back
    seen = ProviderLimits(
        remaining_tokens=1000, reset_tokens_s=1.0, remaining_requests=3, reset_requests_s=0.5
    )
    view = ctl.observe(seen, mark)
    # More in flight than remained is a debt, below zero: the schedule must hold all of it.
    assert (view["rem_t"], view["rem_r"]) == (700, -1)
    # The bucket's capacity, from the provider's own numbers: 1000 + 1 s x 1000/s of tokens is
    # 2 s of the rate, and 3 + 0.5 s x 20/s of requests 0.65 s; the burst is the smaller, less
    # a send's jitter.
    assert view["cap_ms"] == pytest.approx(650 - 100)


def test_what_was_sent_after_a_request_comes_off_at_the_providers_own_count():
    # The provider counts 1.5 prompt tokens per estimated one (characters/4, another
    # tokenizer). The four sends after the answered one went out before any answer taught it:
    # they come off its remaining at 1.5 too, or the schedule would promise a third too much.
    from batch_llm_assets.engine.controller import Controller
    from batch_llm_assets.engine.usage import ProviderLimits

    lim = RedisLimiter(aioredis.Redis(), namespace="t:{x}", settings=LimiterSettings(tpm=60_000))
    ctl = Controller(lim)
    ctl._dims[1].bucket = True
    mark = ctl.on_send(60, 40)
    for _ in range(4):
        ctl.on_send(100, 40)
    ctl.calibrate(140, 40, usage_prompt=150)  # the answer: 150 prompt tokens for 100 estimated
    view = ctl.observe(ProviderLimits(remaining_tokens=2000, reset_tokens_s=1.0), mark)
    assert view["rem_t"] == 2000 - 4 * (150 + 40)


def test_a_slowdown_does_not_widen_the_burst_learned_from_a_bucket():
    # After 429s the factor paces the sends slower; the provider's bucket is no larger. Counted
    # in seconds of the slowed rate, the burst grew with each cut (x0.5: twice as wide) and its
    # margin shrank in tokens, and the next burst overran the bucket: a cascade of 429s.
    from batch_llm_assets.engine.controller import Controller
    from batch_llm_assets.engine.usage import ProviderLimits

    lim = RedisLimiter(aioredis.Redis(), namespace="t:{x}", settings=LimiterSettings(tpm=60_000))
    ctl = Controller(lim)
    ctl._dims[1].bucket = True
    seen = ProviderLimits(remaining_tokens=300, reset_tokens_s=0.2)
    views = []
    for factor in (1.0, 0.5, 0.25):
        lim.factor = factor
        views.append(ctl.observe(seen, ctl.on_send(0, 0))["cap_ms"])
    # 300 tokens at 1000/s and 0.2 s to refill the rest: a 0.5 s bucket, less the 0.1 s margin.
    assert views == [pytest.approx(400)] * 3


# -- engine runs against the simulator ----------------------------------------------------------


def test_a_provider_bucket_of_a_minute_is_used_whole(fresh_sim, valkey_url):
    # 60k tokens/min in a 60 s bucket: 40 requests of ~300 tokens take 12 s at the per-minute
    # pace, but the provider takes them at once; its remaining/reset headers show it.
    fresh_sim.configure(tpm=60_000, rpm=6000, bucket_s=60.0)
    llm = make(
        fresh_sim,
        tpm=60_000,
        rpm=6000,
        redis_url=valkey_url,
        job_key="minute-bucket",
        params={"max_tokens": 200},
        max_concurrency=8,
    )
    started = time.monotonic()
    results, _ = run_engine(llm, [ChatRequest(i, user(f"m{i} " * 80)) for i in range(40)])
    assert all(r.ok for r in results.values())
    assert time.monotonic() - started < 6
    assert fresh_sim.stats().get("rate_limited", 0) == 0


def test_a_capacity_sent_as_the_limit_does_not_cut_the_rate(fresh_sim, valkey_url):
    fresh_sim.configure(rpm=1200, bucket_s=1.0, limit_header="capacity")
    llm = make(fresh_sim, rpm=1200, redis_url=valkey_url, job_key="capacity-header")
    started = time.monotonic()
    results, engine = run_engine(llm, [ChatRequest(i, user(f"c{i}")) for i in range(60)])
    assert all(r.ok for r in results.values())
    assert engine.limiter.rpm == 1200  # 20 (the bucket) was not taken as requests/min
    assert time.monotonic() - started < 6  # 60 requests at 20/s: 3 s (at 20/min: 3 min)


@pytest.mark.parametrize("rate_headers", [True, False], ids=["remaining-reset", "no-headers"])
def test_a_limit_configured_too_high_without_a_limit_header_is_not_a_429_storm(
    fresh_sim, valkey_url, rate_headers
):
    # Configured 20 % over the provider's 1,200 requests/min, no x-ratelimit-limit-* to correct
    # it. With remaining/reset on every answer, the provider gate refilled the bucket at the
    # configured rate and sent ahead of the provider: 73-133 429s for 240 requests (a third of
    # what was sent), and the 429s' decreases slowed a limiter the gate was ahead of anyway.
    # The gate now refills at the rate the limiter paces at, decreases included.
    # With no rate headers at all, the first 429 woke the 64 sleepers, and their old slots
    # went back one by one among their fresh acquires: each refund pulled the schedule's end
    # back under a slot just granted, and the next acquire was granted it again. Sends went
    # out several at once, every 429 woke the sleepers again: 900-1,500 429s and 20-30 rows
    # failed after 20 attempts, in three runs of four. The sleepers' slots now go back in one
    # call before any fresh acquire (docs/engine.md).
    fresh_sim.configure(rpm=1200, bucket_s=1.0, limit_header="none", rate_headers=rate_headers)
    llm = make(fresh_sim, rpm=1440, redis_url=valkey_url, job_key="too-high", max_attempts=20)
    results, _ = run_engine(llm, [ChatRequest(i, user(f"h{i}")) for i in range(240)])
    assert all(r.ok for r in results.values())
    # An idle host: 2-4 429s. A busy one (four CPU hogs on two cores, or the suite's own load)
    # reads answers late: up to 18 with remaining/reset, as the bucket is sized at the
    # configured rate, a fifth too wide (known: docs/benchmarks.md). Far from the storms.
    assert fresh_sim.stats().get("rate_limited", 0) <= (24 if rate_headers else 5)


def test_a_whole_second_retry_after_is_no_shared_pause(fresh_sim, valkey_url):
    fresh_sim.configure(rpm=600, bucket_s=0.5, retry_after="seconds", limit_header="none")
    llm = make(fresh_sim, rpm=1200, redis_url=valkey_url, job_key="whole-second", max_attempts=20)
    results, _ = run_engine(llm, [ChatRequest(i, user(f"w{i}")) for i in range(40)])
    assert all(r.ok for r in results.values())
    assert sum(r.http_429 for r in results.values()) > 0
    assert state(valkey_url, llm).get("pause", 0) == 0


def test_a_provider_that_counts_otherwise_is_reserved_what_it_charges(fresh_sim, valkey_url):
    # The provider counts a quarter of the body's characters (1.33x tiktoken's prompt count
    # here): the engine learns the ratio from the usage and reserves what the provider charges.
    fresh_sim.configure(tpm=600_000, rpm=60_000, bucket_s=1.0, counting="chars4")
    llm = make(
        fresh_sim,
        model="gpt-4o-mini",
        tpm=600_000,
        rpm=60_000,
        redis_url=valkey_url,
        job_key="chars4",
        params={"max_tokens": 64},
        max_attempts=20,
    )
    words = "markets rally as inflation cools bank shares slide oil climbs"
    reqs = [ChatRequest(i, user(f"Headline {i}: " + words * 4)) for i in range(200)]
    results, engine = run_engine(llm, reqs)
    assert [r.error_message for r in results.values() if not r.ok] == []
    # The calibration is what this test checks: without it (CALIBRATION_MAX at 1.0) it stays
    # 1.0. The 429s do not tell the two apart here: the remaining headers correct the count
    # (0-1 with it in 12 runs, 0-3 without it in 9, idle and beside four CPU hogs). A 429
    # comes when the burst widens (0.5 s to the bucket's 0.9 s) and a request granted just
    # before is in neither the answer's remaining nor what was sent since (docs/engine.md,
    # Known limits); a full CI run on three workers saw 3. The bound is against a storm.
    assert engine.pacer.controller.calibration > 1.3
    assert fresh_sim.stats().get("rate_limited", 0) <= 6
