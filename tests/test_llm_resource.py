"""LLMResource against the simulator over real HTTP: results, retries, fatal errors, bad input."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis

from batch_llm_assets import ChatRequest, LLMResource
from batch_llm_assets.engine import count_prompt_tokens
from batch_llm_assets.engine.limiter import limiter_namespace
from batch_llm_assets.engine.pacing import Pacer

from .conftest import SIM_KEY


def user(text):
    return [{"role": "user", "content": text}]


def run(llm: LLMResource, requests) -> dict:
    async def main():
        return {r.id: r async for r in llm.chat_batch(requests)}

    with llm:
        return asyncio.run(main())


pytestmark = pytest.mark.usefixtures("fresh_limiter_state")


def _forget_limiter_state(llm: LLMResource) -> None:
    """A limiter that starts from scratch: delete this key's shared state in Redis."""
    ns = limiter_namespace(llm.base_url, llm.model, llm.api_key)
    client = redis.Redis.from_url(llm.redis_url)
    try:
        for key in client.scan_iter(match=ns.replace("[", "\\[") + "*"):
            client.delete(key)
    finally:
        client.close()


def make(sim, **kw) -> LLMResource:
    settings = {"base_url": sim.url, "api_key": SIM_KEY, "model": "sim-1", "max_attempts": 6}
    return LLMResource(**(settings | kw))


@pytest.mark.parametrize("transport", ["aiohttp", "openai"])
def test_results_carry_text_usage_and_latency(fresh_sim, transport):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    results = run(
        make(fresh_sim, transport=transport, params={"max_tokens": 30}, estimate_margin=0.0),
        [ChatRequest(i, messages) for i in range(20)],
    )
    assert len(results) == 20
    r = results[0]
    assert r.status == "ok" and r.response and r.finish_reason in ("stop", "length")
    assert r.prompt_tokens == count_prompt_tokens(messages, "sim-1")
    assert 0 < r.completion_tokens <= 30
    assert r.latency_ms > 0 and r.attempts == 1 and r.error_class is None
    assert r.estimated_tokens == r.prompt_tokens + 30  # the estimate is exact, plus max_tokens


@pytest.mark.parametrize("transport", ["aiohttp", "openai"])
def test_retries_recover_injected_faults(fresh_sim, transport):
    fresh_sim.configure(fail_500=0.15, fail_503=0.15, drop=0.1, hang=0.05, hang_s=30.0)
    llm = make(fresh_sim, transport=transport, request_timeout_s=1.0, max_attempts=10)
    results = run(llm, [ChatRequest(i, user(f"row {i}")) for i in range(120)])
    assert all(r.ok for r in results.values()), {r.error_class for r in results.values()}
    assert sum(r.attempts > 1 for r in results.values()) > 20
    stats = fresh_sim.stats()
    assert stats["fault_500"] and stats["fault_503"] and stats["fault_drop"] and stats["fault_hang"]


def test_malformed_bodies_are_retried(fresh_sim):
    fresh_sim.configure(malformed=0.3)
    results = run(
        make(fresh_sim, max_attempts=10), [ChatRequest(i, user(f"m{i}")) for i in range(40)]
    )
    assert all(r.ok for r in results.values())
    assert fresh_sim.stats()["fault_malformed"] > 0


def test_attempts_are_bounded(fresh_sim):
    fresh_sim.configure(fail_503=1.0)
    results = run(make(fresh_sim, max_attempts=2), [ChatRequest(i, user("x")) for i in range(3)])
    for r in results.values():
        assert r.status == "failed" and r.error_class == "server_error" and r.attempts == 2
        assert "503" in r.error_message
    assert fresh_sim.stats()["received"] == 6


def test_a_bad_request_fails_alone_and_is_not_retried(fresh_sim):
    reqs = [ChatRequest(i, user(f"ok {i}")) for i in range(10)]
    reqs.append(ChatRequest("bad", user("x"), params={"temperature": 9}))
    results = run(make(fresh_sim), reqs)
    bad = results.pop("bad")
    assert bad.status == "failed" and bad.error_class == "bad_request" and bad.attempts == 1
    assert "temperature" in bad.error_message
    assert all(r.ok for r in results.values())


def test_context_length_from_the_server_is_not_retried(fresh_sim):
    # sim-1 is not in the client's table of context windows; with the window given too large,
    # only the server's 400 says it (and it is not retried).
    results = run(
        make(fresh_sim, context_window=1_000_000),
        [ChatRequest("long", user("word " * 20_000)), ChatRequest("short", user("hi"))],
    )
    assert results["long"].error_class == "context_length" and results["long"].attempts == 1
    assert results["short"].ok


def test_bad_input_fails_without_a_network_call(fresh_sim):
    reqs = [
        ChatRequest("none", None),
        ChatRequest("null", user(None)),
        ChatRequest("blank", user("   ")),
        ChatRequest("no-user", [{"role": "system", "content": "x"}]),
        ChatRequest("huge", user("word " * 5000)),
        # A NaN is not JSON: json wrote it anyway (the provider answered 400), orjson as null
        # (the parameter silently gone). Neither is sent.
        ChatRequest("nan", user("hi"), params={"temperature": float("nan")}),
        ChatRequest("inf", user("hi"), params={"logit_bias": {"1": [float("inf")]}}),
    ]
    results = run(make(fresh_sim, context_window=2000), reqs)
    for key in ("none", "null", "blank", "no-user"):
        assert results[key].error_class == "empty_prompt" and results[key].attempts == 0
    assert results["huge"].error_class == "context_length"
    assert "2000" in results["huge"].error_message
    for key in ("nan", "inf"):
        assert results[key].error_class == "bad_request"
        assert "NaN or infinite" in results[key].error_message
    assert fresh_sim.stats().get("received", 0) == 0
    with pytest.raises(ValueError, match="NaN or infinite"):
        run(make(fresh_sim, params={"top_p": float("-inf")}), [ChatRequest("x", user("hi"))])


def test_text_orjson_refuses_goes_as_json_writes_it(fresh_sim):
    # The aiohttp transport writes bodies with orjson, which refuses a lone surrogate (a row's
    # broken text) and ints over 64 bits; those go through json as before, and are answered.
    reqs = [
        ChatRequest("surrogate", user("up or down? \ud83d")),
        ChatRequest("bigint", user("hi"), params={"seed": 2**70}),
    ]
    results = run(make(fresh_sim), reqs)
    assert {k: r.status for k, r in results.items()} == {"surrogate": "ok", "bigint": "ok"}
    assert fresh_sim.stats()["answered"] == 2


def test_bad_key_fails_fast_without_leaking_it(fresh_sim, caplog):
    secret = "sk-planted-secret-key-987654321"
    llm = make(fresh_sim, api_key=secret, max_concurrency=4, fatal_error_threshold=3)
    with caplog.at_level(logging.DEBUG):
        results = run(llm, [ChatRequest(i, user(f"r{i}")) for i in range(200)])
    classes = [r.error_class for r in results.values()]
    assert set(classes) == {"authentication", "aborted"}
    assert classes.count("aborted") > 150
    assert fresh_sim.stats()["received"] <= 3 + 4  # the threshold, plus what was in flight
    text = caplog.text + repr(llm) + "".join(str(r) for r in results.values())
    assert secret not in text and secret[3:12] not in text and secret[-6:] not in text


def test_deadline_fails_requests_that_cannot_be_sent_in_time(fresh_sim):
    fresh_sim.configure(hang=1.0, hang_s=30.0)
    started = time.monotonic()
    results = run(
        make(fresh_sim, deadline_s=1.0, request_timeout_s=10),
        [ChatRequest(i, user("x")) for i in range(3)],
    )
    assert time.monotonic() - started < 5
    assert {r.error_class for r in results.values()} == {"deadline_exceeded"}


def test_deadline_passed_while_waiting_for_the_limiter_is_not_sent(fresh_sim, valkey_url):
    # 60 requests/min, burst of one: the 3rd request would wait ~2 s, past its 1 s deadline.
    # Each deadline counts from when the engine takes the request, not from before the engine
    # opened (the server probe, Redis): on a busy host that alone can take half a second.
    llm = make(
        fresh_sim,
        rpm=60,
        burst_s=1.0,
        redis_url=valkey_url,
        job_key="deadline-test",
        max_concurrency=8,
    )
    reqs = (ChatRequest(i, user(f"d{i}"), deadline=time.monotonic() + 1.0) for i in range(6))
    results = run(llm, reqs)
    sent = [r for r in results.values() if r.ok]
    late = [r for r in results.values() if r.error_class == "deadline_exceeded"]
    assert len(sent) >= 1 and len(late) >= 3 and len(sent) + len(late) == 6
    assert fresh_sim.stats()["received"] == len(sent)


def test_429s_that_get_through_are_retried_and_slow_the_bucket(fresh_sim, valkey_url):
    # The key's real limit (the simulator's) is half what the resource was told. No
    # remaining/reset headers: the provider gate would hold the sends that get 429s here. A
    # configured burst of half a second, so the first one overruns the bucket (with the default
    # of none, the stated limit comes back before a 429 can).
    fresh_sim.configure(rpm=600, bucket_s=0.5, rate_headers=False)
    llm = make(
        fresh_sim, rpm=1200, burst_s=0.5, redis_url=valkey_url, job_key="429-test", max_attempts=20
    )
    _forget_limiter_state(llm)  # earlier tests on this key leave a learned rate and burst
    results = run(llm, [ChatRequest(i, user(f"q{i}")) for i in range(60)])
    assert all(r.ok for r in results.values())
    assert sum(r.http_429 for r in results.values()) > 0
    # The 429s slowed the bucket and the provider's headers told it the real limit: the only
    # 429s are those of the first burst, sent at the wrong rate before any answer came back.
    # Requests held on slots granted at that rate are re-slotted together, paced: until the
    # herd fix (issue 10) each took back the slot the one before had just given up, so they
    # all went in one instant seconds later, a second storm of 5-20 429s.
    stats = fresh_sim.stats()
    assert stats["rate_limited"] < stats["admitted_requests"]
    per_second = [s["rate_limited"] for s in stats["series"]]
    assert sum(per_second[2:]) == 0, per_second


def test_embedded_valkey_is_started_and_stopped_with_the_resource(fresh_sim):
    llm = make(fresh_sim, rpm=6000)
    with llm:
        url = llm.effective_redis_url
        assert url and url.startswith("redis://127.0.0.1:")

        async def one():
            return [r async for r in llm.chat_batch([ChatRequest(1, user("x"))])]

        assert asyncio.run(one())[0].ok
    assert llm.effective_redis_url is None


def test_api_key_is_not_in_repr():
    llm = LLMResource(api_key="sk-should-not-show-1234")
    assert "sk-should-not-show" not in repr(llm) and "sk-should-not-show" not in str(llm)


def test_bad_base_url_is_a_clear_error():
    with pytest.raises(Exception, match="base_url must start with http"):
        LLMResource(base_url="api.openai.com")


@pytest.mark.parametrize(
    "field, value",
    [
        ("job_weight", float("inf")),  # every other job's share NaN in the limiter
        ("job_weight", float("nan")),
        ("deadline_s", float("nan")),  # never reached: no deadline at all
        ("deadline_s", -1.0),  # every row deadline_exceeded, nothing sent
        ("deadline_s", float("inf")),
        ("request_timeout_s", float("inf")),
        ("price_input_per_1m", float("nan")),  # NaN costs in the metadata and the budget
        ("price_output_per_1m", -2.0),  # a negative cost frees budget
        ("price_cached_input_per_1m", float("inf")),
        ("job_key", ""),
        ("job_key", "team\udc80"),  # a lone surrogate: no Redis key can hold it
        ("job_key", "a\nb"),  # a line break in the limiter's lease members and logs
        ("job_key", "a\x85b"),  # a C1 control character (NEL, a line break to some readers)
        ("job_key", "j" * 201),
    ],
)
def test_a_config_value_no_run_could_use_is_refused_naming_its_field(field, value):
    with pytest.raises(Exception, match=field) as err:
        LLMResource(**{field: value})
    assert "validation error" in str(err.value)


def test_a_job_key_may_hold_any_printable_text():
    assert LLMResource(job_key="team a|b: ünïcode ✓").job_key == "team a|b: ünïcode ✓"


def test_an_engine_holds_a_bounded_pool_of_redis_connections(fresh_sim, valkey_url):
    # 64 in flight used to open 64 connections to the limiter's Redis on the first wave of
    # acquires (40-80 ms before the first send, and 64 clients per process on the server).
    import redis.asyncio as aioredis

    from batch_llm_assets.engine import _constants as C

    llm = make(fresh_sim, rpm=600_000, redis_url=valkey_url, job_key="pool", max_concurrency=64)

    async def main():
        probe = aioredis.Redis.from_url(valkey_url)
        base = len(await probe.client_list())
        peak, done = base, False

        async def sample():
            nonlocal peak
            while not done:
                peak = max(peak, len(await probe.client_list()))
                await asyncio.sleep(0.002)

        sampler = asyncio.create_task(sample())
        try:
            reqs = (ChatRequest(i, user(f"p{i}")) for i in range(300))
            results = [r async for r in llm.chat_batch(reqs)]
        finally:
            done = True
            await sampler
            await probe.aclose()
        return results, peak - base

    with llm:
        results, opened = asyncio.run(main())
    assert all(r.ok for r in results)
    assert 1 <= opened <= C.REDIS_MAX_CONNECTIONS, opened


def test_a_minute_long_bucket_is_used_whole_at_the_start(fresh_sim, valkey_url, monkeypatch):
    # The provider's bucket holds 120 requests (a minute at 120/min); an engine alone on the key
    # learns it from the first answer's headers and sends the rest at once. Requests that took
    # slots before that answer, from the default half-second burst (slots half a second apart),
    # are woken when the burst widens and take fresh slots. Judged against the moment of the
    # widening, not the clock, so a busy host (later answers) does not change the outcome.
    fresh_sim.configure(rpm=120, bucket_s=60.0)
    llm = make(fresh_sim, rpm=120, redis_url=valkey_url, job_key="minute", max_concurrency=64)
    _forget_limiter_state(llm)
    sends: list[tuple[float, float]] = []  # (when it asked for a slot, when it was sent)
    widened_at: list[float] = []  # when this engine first heard the burst is the whole bucket
    slot, after_reply = Pacer.slot, Pacer._after_reply

    async def recorded_slot(self, *args):  # spies: the real methods, times noted
        asked = time.monotonic()
        grant = await slot(self, *args)
        sends.append((asked, time.monotonic()))
        return grant

    def recorded_after_reply(self):
        after_reply(self)
        if self.limiter.burst_s > 59.0 and not widened_at:
            widened_at.append(time.monotonic())

    monkeypatch.setattr(Pacer, "slot", recorded_slot)
    monkeypatch.setattr(Pacer, "_after_reply", recorded_after_reply)

    async def main():
        reqs = (ChatRequest(i, user(f"m{i}")) for i in range(110))
        return [r async for r in llm.chat_batch(reqs)]

    with llm:
        results = asyncio.run(main())
    assert all(r.ok for r in results)
    assert sum(r.http_429 for r in results) == 0
    assert len(sends) == 110
    assert widened_at  # the burst did widen to the bucket
    # Asked before the widening and sent more than 3 s after it: a request that slept on its old
    # slot instead of taking a fresh one (without the wake: dozens, up to 24 s; with it, a busy
    # host's event loop still delays a few by a second or two).
    slept_through = [sent - asked for asked, sent in sends if asked < widened_at[0] < sent - 3.0]
    assert not slept_through, slept_through
