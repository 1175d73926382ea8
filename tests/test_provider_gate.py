"""The provider gate (engine/provider_gate.py): what the provider's remaining/reset headers say
it can take, held against the engine's sends. The headers come from the simulator's own
enforcement classes (simulator/limits.py), as its server sends them; the last test runs the
engine against the simulator over HTTP."""

from __future__ import annotations

import asyncio
import heapq
import random

import pytest
import redis

from batch_llm_assets import ChatRequest, LLMResource
from batch_llm_assets.engine.provider_gate import ProviderGate
from batch_llm_assets.engine.usage import ProviderLimits
from batch_llm_assets.simulator.limits import make_limit

from .conftest import SIM_KEY


def _drive(
    gate: ProviderGate, limit, sends: list[float], sent: list[int] | None = None, every: int = 1
):
    """One request per send time: the provider takes it, its answer's headers reach the gate
    (every `every`th answer's only). Returns the gate's wait for one more request at each send
    (or, given the engine's send counter `sent`, that counter moved on)."""
    keep, waits = sent, []
    sent = [0, 0] if sent is None else sent
    for i, t in enumerate(sends):
        waits.append(gate.wait_s(0, t, sent))
        limit.take(1, t)
        sent[1] += 1
        headers = ProviderLimits(
            remaining_requests=limit.remaining(t), reset_requests_s=limit.reset_s(t)
        )
        if i % every == 0:
            gate.observe(headers, t, (sent[0], sent[1]))
    return waits if keep is None else sent


@pytest.mark.parametrize(
    ("shape", "window"),
    [
        ({"enforcement": "bucket", "bucket_s": 10.0}, False),
        ({"enforcement": "bucket", "bucket_s": 1.0}, False),
        ({"enforcement": "fixed_window", "window_s": 10.0}, True),
        ({"enforcement": "sliding_window", "window_s": 10.0}, True),
        ({"enforcement": "quantized"}, True),
    ],
)
def test_a_window_is_told_from_a_bucket_by_its_headers(shape, window):
    # 600/min: a burst of 8 requests 20 ms apart, as a job's first answers show it.
    gate = ProviderGate(rpm=600, tpm=None)
    _drive(gate, make_limit(600, now=0.0, **shape), [i * 0.02 for i in range(8)])
    assert gate.requests.window is window
    assert (gate.window_s > 0) is window


def test_a_bucket_whose_reset_is_sent_in_whole_seconds_is_no_window():
    # OpenAI writes a reset of minutes as `6m0s`: between answers 10 ms apart it mostly does
    # not change. That is rounding, not a window.
    gate = ProviderGate(rpm=None, tpm=60_000)  # 1000 tokens/s
    limit = make_limit(60_000, enforcement="bucket", bucket_s=600.0, now=0.0)
    limit.take(100_000, 0.0)  # 100 s to refill
    sent = [100_000, 1]
    for i in range(1, 100):
        t = i * 0.01
        limit.take(100, t)  # ten times the refill
        sent[0] += 100
        sent[1] += 1
        reset = float(round(limit.reset_s(t)))
        limits = ProviderLimits(remaining_tokens=limit.remaining(t), reset_tokens_s=reset)
        gate.observe(limits, t, (sent[0], sent[1]))
    assert gate.tokens.window is False


def test_a_spent_window_holds_the_next_send_until_its_reset():
    # 600/min in windows of 10 s: 100 per window. 100 sent in the first second.
    gate = ProviderGate(rpm=600, tpm=None)
    limit = make_limit(600, enforcement="fixed_window", window_s=10.0, now=0.0)
    waits = _drive(gate, limit, [i * 0.01 for i in range(100)])
    assert waits == [0.0] * 100
    # A refilling bucket would have 10 more by t = 2 s; the window has none until t = 10 s.
    wait = gate.wait_s(0, 2.0, [0, 100])
    assert 7.9 < wait <= 8.1
    assert limit.wait_for(1, 2.0) > 0  # the provider agrees
    # After the reset, a fresh window: what the first gave (100: the most the headers showed
    # was 99, after its first request), less what went since.
    assert gate.wait_s(0, 10.02, [0, 100]) == 0.0
    assert gate.wait_s(0, 10.03, [0, 199]) == 0.0
    assert gate.wait_s(0, 10.04, [0, 200]) > 9.0


def test_a_bucket_is_refilled_at_its_rate():
    gate = ProviderGate(rpm=600, tpm=None)
    limit = make_limit(600, enforcement="bucket", bucket_s=1.0, now=0.0)  # 10 at once, 10/s
    _drive(gate, limit, [i * 0.001 for i in range(10)])
    assert gate.requests.window is False
    # 0.09 left at t = 0.009 (the header shows 0): one more request refills by t = 0.1.
    true_wait = limit.wait_for(1, 0.01)
    assert true_wait <= gate.wait_s(0, 0.01, [0, 10]) <= true_wait + 0.005
    assert gate.wait_s(0, 0.2, [0, 10]) == 0.0
    # Sends the provider has not reported yet count against what it showed.
    assert gate.wait_s(0, 0.2, [0, 12]) > 0


def test_a_bucket_s_level_counts_the_fraction_its_header_leaves_out():
    # A minute's bucket of 285 requests refills one in 0.21 s. Its header floors the level
    # (0.42 left shows 0); the reset tells the fraction. Before, the gate waited the whole
    # 0.21 s for a request the provider could take in 0.12 s: one request's time per job.
    gate = ProviderGate(rpm=285, tpm=None)
    limit = make_limit(285, enforcement="bucket", bucket_s=60.0, now=0.0)
    limit.take(280, 0.0)
    sent = [0, 280]
    for t in (0.05, 0.1, 0.15, 0.2, 0.25, 0.3):  # each answer's fraction differs
        limit.take(1, t)
        sent[1] += 1
        headers = ProviderLimits(
            remaining_requests=limit.remaining(t), reset_requests_s=round(limit.reset_s(t), 3)
        )
        gate.observe(headers, t, (sent[0], sent[1]))
    assert limit.remaining(0.3) == 0 and 0.4 < limit.level < 0.45
    true_wait = limit.wait_for(1, 0.3)  # 0.12 s
    assert true_wait <= gate.wait_s(0, 0.3, sent) <= true_wait + 0.05  # not early; not 0.21


def test_an_older_answer_does_not_overwrite_a_newer_snapshot():
    gate = ProviderGate(rpm=600, tpm=None)
    gate.observe(ProviderLimits(remaining_requests=3, reset_requests_s=0.7), 1.0, (0, 7))
    gate.observe(ProviderLimits(remaining_requests=9, reset_requests_s=0.1), 0.5, (0, 1))
    assert gate.requests.remaining == 3


def test_a_fixed_window_provider_gets_no_429_at_the_window_edge(fresh_sim, valkey_url):
    # 600 requests/min in fixed windows of 3 s: 30 per window. 45 requests take two windows.
    # A schedule that refills continuously sends on into the spent window and takes 429s
    # there; the gate holds those sends until the window resets.
    fresh_sim.configure(rpm=600, enforcement="fixed_window", window_s=3.0)
    r = redis.Redis.from_url(valkey_url)
    for key in r.scan_iter("bla:*"):
        r.delete(key)
    llm = LLMResource(
        base_url=fresh_sim.url,
        api_key=SIM_KEY,
        model="sim-1",
        rpm=600,
        redis_url=valkey_url,
        job_key="fixed-window",
        max_concurrency=16,
    )

    async def main():
        return [
            x
            async for x in llm.chat_batch(
                ChatRequest(i, [{"role": "user", "content": f"w{i}"}]) for i in range(45)
            )
        ]

    with llm:
        results = asyncio.run(main())
    assert all(x.ok for x in results)
    assert fresh_sim.stats().get("rate_limited", 0) == 0


def test_a_sliding_window_frees_each_send_a_window_after_it_went():
    # 100 requests per sliding 10 s: 99 in a burst, one straggler at 2.5 s. The window's reset
    # says when all of it is free (12.5 s); the burst's sends leave it from 10 s. The gate
    # waited for the reset: a matrix cell took 12.7 s against an ideal of 10.
    gate = ProviderGate(rpm=600, tpm=None)
    limit = make_limit(600, enforcement="sliding_window", window_s=10.0, now=0.0)
    _drive(gate, limit, [i * 0.001 for i in range(99)] + [2.5])
    assert gate.requests.window
    true_wait = limit.wait_for(1, 3.0)  # 7 s: the burst's first send leaves at 10 s
    assert true_wait <= gate.wait_s(0, 3.0, [0, 100]) <= true_wait + 0.1
    # A fixed window the same sends filled stays shut until its reset.
    gate = ProviderGate(rpm=600, tpm=None)
    limit = make_limit(600, enforcement="fixed_window", window_s=10.0, now=0.0)
    _drive(gate, limit, [i * 0.001 for i in range(99)] + [2.5])
    assert limit.wait_for(1, 3.0) <= gate.wait_s(0, 3.0, [0, 100]) <= limit.wait_for(1, 3.0) + 0.1


def _client(gate: ProviderGate, limit, n: int, *, pause: tuple[int, float]) -> tuple[float, int]:
    """A client that sends n requests as early as the gate lets it, answers 30 ms after each,
    and the send numbered pause[0] not before pause[1]. Returns (the last send, 429s)."""
    rnd = random.Random(0)
    answers: list[tuple[float, float, ProviderLimits, tuple[int, int]]] = []
    t, rejected, sent = 0.0, 0, [0, 0]
    while sent[1] < n:
        while answers and answers[0][0] <= t:
            _, at, headers, snapshot = heapq.heappop(answers)
            gate.observe(headers, at, snapshot)
        if sent[1] == pause[0]:
            t = max(t, pause[1])
        if (wait := gate.wait_s(0, t, sent)) > 0:
            t = min(t + wait, answers[0][0]) if answers else t + wait
            continue
        arrive = t + rnd.uniform(0, 0.01)
        rejected += limit.wait_for(1, arrive) > 0
        limit.take(1, arrive)
        sent[1] += 1
        headers = ProviderLimits(
            remaining_requests=limit.remaining(arrive),
            reset_requests_s=round(limit.reset_s(arrive), 3),
        )
        heapq.heappush(answers, (arrive + 0.03, t, headers, (sent[0], sent[1])))
        t += rnd.uniform(0, 0.002)
    return t, rejected


@pytest.mark.parametrize(
    ("enforcement", "ideal"), [("sliding_window", 20.0), ("fixed_window", 20.0)]
)
def test_a_window_s_sends_after_a_pause_go_as_the_window_frees_them(enforcement, ideal):
    # 250 requests at 100 per 10 s; the 96th waits till 2.5 s (a slow row). A sliding window
    # frees the first 95 at 10 s and the rest at 12.5 s; the gate waited for 12.5 s, each
    # window (22.7 s in all). Neither window shape gets a 429.
    gate = ProviderGate(rpm=600, tpm=None)
    limit = make_limit(600, enforcement=enforcement, window_s=10.0, now=0.0)
    last, rejected = _client(gate, limit, 250, pause=(95, 2.5))
    assert rejected == 0
    assert ideal <= last <= ideal + 0.25


def test_a_send_the_snapshot_only_just_covers_waits():
    # Found in the matrix's 1 s bucket cells: the provider takes its snapshot a little after
    # the send (so a bucket is credited its refill from 2 ms after it), and on short prompts it
    # counts a few framing tokens the calibration's ratio does not scale (32 tokens are kept
    # besides the 10 %). Sends that the snapshot only just covered got 429s.
    gate = ProviderGate(rpm=13_500, tpm=60_000)  # 225 requests/s, 1000 tokens/s
    gate.observe(ProviderLimits(remaining_requests=0, reset_requests_s=1.0), 1.0, (0, 50))
    assert gate.wait_s(0, 1.0 + 1 / 225, [0, 50]) > 0  # the refill's last 2 ms not credited
    assert gate.wait_s(0, 1.0 + 1 / 225 + 0.002, [0, 50]) == 0
    gate.observe(ProviderLimits(remaining_tokens=1000, reset_tokens_s=0.0), 1.5, (0, 55))
    gate.observe(ProviderLimits(remaining_tokens=130, reset_tokens_s=0.87), 2.0, (1000, 60))
    assert gate.wait_s(100, 2.0, [1000, 60]) > 0  # 100 x 1.1 + 32 = 142 > 130
    assert gate.wait_s(85, 2.0, [1000, 60]) == 0  # 125.5


def test_answers_taken_out_of_order_do_not_overfill_a_window():
    # 100 per 10 s window. The provider took three sends (97-99) after the 100th, so the 100th's
    # answer says 3 remain: by the latest answer alone, three more could go, and the matrix's
    # quantized cells got 1-4 429s a run that way. The median of the window's answers holds.
    gate = ProviderGate(rpm=600, tpm=None)
    limit = make_limit(600, enforcement="fixed_window", window_s=10.0, now=0.0)
    _drive(gate, limit, [i * 0.01 for i in range(96)])
    assert gate.requests.window
    late = ProviderLimits(remaining_requests=3, reset_requests_s=9.0)
    gate.observe(late, 1.0, (0, 100))  # the 100th send, its answer first
    for n in (97, 98, 99):
        gate.observe(ProviderLimits(remaining_requests=0, reset_requests_s=9.0), 0.99, (0, n))
    assert gate.wait_s(0, 1.01, [0, 100]) > 8.0


def test_sends_before_the_calibration_count_at_the_ratio_learnt_later():
    # Found in the matrix's quantized cells with characters/4 counting: the job's first burst
    # goes out at a ratio of 1 (nothing learnt yet) while the provider counts its prompts 1.5
    # times the estimate. Counted at the ratio of their send, those sends made the window look
    # emptier than it was: 1-4 429s at the window's end. The gate weighs them at the ratio the
    # engine has now. 10,000 tokens per 10 s window; each request: 100 estimated prompt tokens
    # (150 as the provider counts them) and 50 of max_tokens.
    gate = ProviderGate(rpm=None, tpm=60_000)
    limit = make_limit(60_000, enforcement="fixed_window", window_s=10.0, now=0.0)
    sent = [0, 0, 0]
    snapshots = []
    for i in range(40):  # the first burst, before any answer
        t = i * 0.001
        assert gate.wait_s(150, t, sent) == 0.0
        limit.take(200, t)
        sent = [sent[0] + 100, sent[1] + 1, sent[2] + 50]
        snapshots.append((t, limit.remaining(t), limit.reset_s(t), tuple(sent)))
    for t, remaining, reset_s, seen in snapshots[:30]:  # 30 answers are in, in order
        gate.observe(ProviderLimits(remaining_tokens=remaining, reset_tokens_s=reset_s), t, seen)
    assert gate.tokens.window
    gate.set_scale(1.5)  # the calibration learnt from their usage
    more, t = 0, 0.1
    while gate.wait_s(200, t, sent) == 0.0:
        limit.take(200, t)
        sent = [sent[0] + 100, sent[1] + 1, sent[2] + 50]
        more += 1
    assert more > 0
    assert limit.remaining(t) >= 0 and limit.used <= limit.capacity  # no send over the window


def test_a_window_ends_when_its_latest_answer_says():
    # An answer's reset counts from when the provider took the request, a little after the
    # send: a send that waited 30 ms on its way makes the window seem to end 30 ms early, and
    # the next window's first sends arrived before it had begun (the matrix's quantized cells).
    gate = ProviderGate(rpm=600, tpm=None)
    limit = make_limit(600, enforcement="fixed_window", window_s=10.0, now=0.0)
    for i in range(100):  # 100 per window, all taken by t = 1 s
        sent_at = i * 0.01
        arrived = sent_at + (0.03 if i == 99 else 0.001)
        limit.take(1, arrived)
        gate.observe(
            ProviderLimits(
                remaining_requests=limit.remaining(arrived),
                reset_requests_s=limit.reset_s(arrived),
            ),
            sent_at,
            (0, i + 1),
        )
    assert gate.requests.window
    assert gate.wait_s(0, 9.99, [0, 100]) > 0.01  # not before the window's end at 10 s
    assert gate.wait_s(0, 10.011, [0, 100]) == 0.0


def test_an_answer_overtaken_on_its_way_does_not_shorten_the_schedule():
    # The provider counts sends in the order they arrive: a request sent before five others
    # but arriving after them (a new connection) answers with those five gone already, and the
    # engine, which counted them after it, takes them off once more. The limiter is told the
    # median of the latest answers' view instead. 100 requests/s in a bucket of 500.
    from batch_llm_assets.engine.provider_gate import RemainingViews

    sends = [i * 0.001 for i in range(30)]
    arrive = {i: t + 0.0005 for i, t in enumerate(sends)} | {20: sends[25] + 0.0006}
    limit = make_limit(6000, enforcement="bucket", bucket_s=5.0, now=0.0)
    in_order = make_limit(6000, enforcement="bucket", bucket_s=5.0, now=0.0)
    snapshot, expected = {}, {}
    for i in sorted(arrive, key=arrive.get):
        limit.take(1, arrive[i])
        snapshot[i] = (limit.remaining(arrive[i]), limit.reset_s(arrive[i]))
    for i, t in enumerate(sends):  # had every request arrived in the order it went
        in_order.take(1, t + 0.0005)
        expected[i] = in_order.remaining(t + 0.0005)
    remaining = RemainingViews()
    told = {}
    for i, t in enumerate(sends):  # answers in the order they went
        left, reset_s = snapshot[i]
        limits = ProviderLimits(remaining_requests=left, reset_requests_s=reset_s)
        told[i] = remaining.of(limits, t, (0, i + 1), None, 6000).remaining_requests
    assert snapshot[20][0] <= expected[20] - 4  # its own answer: five more gone
    assert all(abs(told[i] - expected[i]) <= 1 for i in range(30)), (told, expected)


def test_the_median_s_remaining_keeps_the_capacity_the_answer_showed():
    # The limiter learns the provider's bucket from remaining + reset x rate. With the median's
    # remaining and the answer's own reset, a capacity of 1.06-1.11 s was read off a 1 s bucket
    # and the burst grew past it. 100 requests/s: views whose median is above this answer's.
    from batch_llm_assets.engine.provider_gate import RemainingViews

    remaining = RemainingViews()
    for i, left in enumerate((60, 60, 60)):
        view = ProviderLimits(remaining_requests=left, reset_requests_s=0.4)
        remaining.of(view, i * 0.001, (0, 0), None, 6000)
    low = ProviderLimits(remaining_requests=20, reset_requests_s=0.8)  # capacity 100, as all
    told = remaining.of(low, 0.003, (0, 0), None, 6000)
    assert told.remaining_requests == 60  # the median view
    assert told.remaining_requests + told.reset_requests_s * 100 == pytest.approx(100)
    # A median above the capacity itself is held to it.
    odd = ProviderLimits(remaining_requests=0, reset_requests_s=0.5)  # capacity 50
    told = remaining.of(odd, 0.004, (0, 0), None, 6000)
    assert (told.remaining_requests, told.reset_requests_s) == (50, 0.0)


@pytest.mark.parametrize(
    ("true", "configured", "shape", "told"),
    [
        (600, 720, {"enforcement": "bucket", "bucket_s": 10.0}, True),  # 20 % over: the refill
        (6000, 7200, {"enforcement": "bucket", "bucket_s": 1.0}, True),
        (600, 600, {"enforcement": "bucket", "bucket_s": 10.0}, False),  # right: nothing to lower
        (600, 720, {"enforcement": "fixed_window", "window_s": 10.0}, False),  # a window's reset
    ],
    ids=["bucket10s", "bucket1s", "configured-right", "window"],
)
def test_a_bucket_s_resets_show_its_refill_rate(true, configured, shape, told):
    # Configured higher than the provider's rate, with no x-ratelimit-limit: each request taken
    # moves a bucket's reset on by 1 / rate, the time between snapshots moves it back. A job's
    # first burst (95 requests 2 ms apart, every 10th answer read, in the order they went)
    # shows the refill before a 429 does.
    gate = ProviderGate(rpm=configured, tpm=None)
    _drive(gate, make_limit(true, now=0.0, **shape), [i * 0.002 for i in range(95)], every=10)
    lower = gate.refill_limits(rpm=configured, tpm=None)
    if told:
        assert lower == {"rpm": pytest.approx(true, rel=0.01)}
    else:
        assert lower == {}


def test_a_bucket_near_full_or_a_429_tells_no_refill():
    # A limit that does not bind stays near full: its refill goes to waste at times, and the
    # sends counted over the reset's moves would read the engine's own rate (it fell 10 % at
    # each answer). A 429 counts a send the provider did not take: the reading stops.
    gate = ProviderGate(rpm=720, tpm=None)
    bucket = make_limit(600, enforcement="bucket", bucket_s=10.0, now=0.0)
    _drive(gate, bucket, [0.5 * i for i in range(40)])
    assert gate.refill_limits(rpm=720, tpm=None) == {}
    gate = ProviderGate(rpm=720, tpm=None)
    bucket = make_limit(600, enforcement="bucket", bucket_s=10.0, now=0.0)
    sent = _drive(gate, bucket, [0.0, 0.002], sent=[0, 0])
    gate.rejected()
    _drive(gate, bucket, [0.004 + i * 0.002 for i in range(70)], sent=sent)
    assert gate.refill_limits(rpm=720, tpm=None) == {}
