"""Engine v2 against the simulator over real HTTP and a real Valkey: error semantics (out of
credit, too large, the breaker, the retry budget), provider profiles and usage shapes, the
provider's rate-limit headers, and a hardened Redis limiter."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time

import pytest
import redis
import redis.asyncio as aioredis

from batch_llm_assets import ChatRequest, LLMResource
from batch_llm_assets.engine import EmbeddedValkey, Engine, EngineSettings, Grant
from batch_llm_assets.engine import errors as E
from batch_llm_assets.engine._constants import FALLBACK_ESTIMATE_MARGIN
from batch_llm_assets.engine.limiter import (
    LimiterSettings,
    RedisLimiter,
    check_redis,
    limiter_namespace,
)
from batch_llm_assets.engine.transport import AiohttpTransport

from .conftest import SIM_KEY


def user(text):
    return [{"role": "user", "content": text}]


def make(sim, **kw) -> LLMResource:
    settings = {"base_url": sim.url, "api_key": SIM_KEY, "model": "sim-1", "max_attempts": 6}
    return LLMResource(**(settings | kw))


pytestmark = pytest.mark.usefixtures("fresh_limiter_state")


def run_engine(llm: LLMResource, requests, **engine_kw):
    """(results by id, the engine) for one chat run through LLMResource.engine."""

    async def main():
        async with llm.engine(**engine_kw) as engine:
            return {r.id: r async for r in engine.map(requests)}, engine

    with llm:
        return asyncio.run(main())


def state(url, llm: LLMResource) -> dict:
    ns = limiter_namespace(llm.base_url, llm.model, llm.api_key)
    raw = redis.Redis.from_url(url).hgetall(f"{ns}:state")
    return {k.decode(): float(v) for k, v in raw.items() if k != b"se"}  # se: an engine's id


# -- error semantics ----------------------------------------------------------------------------


def test_insufficient_quota_trips_at_once_and_never_slows_the_limiter(fresh_sim, valkey_url):
    fresh_sim.configure(insufficient_quota=True)
    llm = make(fresh_sim, rpm=6000, redis_url=valkey_url, job_key="quota", max_concurrency=4)
    results, engine = run_engine(llm, [ChatRequest(i, user(f"q{i}")) for i in range(50)])
    classes = [r.error_class for r in results.values()]
    assert set(classes) == {"insufficient_quota", "aborted"}
    assert "out of credit" in engine.aborted_reason
    assert fresh_sim.stats()["received"] <= 4  # what was in flight when the first answer came
    assert all(r.attempts <= 1 and r.http_429 == 0 for r in results.values())
    assert state(valkey_url, llm).get("f", 1.0) == 1.0  # the shared rate was not touched


def test_a_request_over_the_tpm_limit_fails_without_being_sent(fresh_sim, valkey_url):
    llm = make(fresh_sim, tpm=2000, redis_url=valkey_url, job_key="too-large")
    results, _ = run_engine(
        llm, [ChatRequest("big", user("word " * 3000)), ChatRequest("small", user("hi"))]
    )
    assert results["big"].error_class == "request_too_large" and results["big"].attempts == 0
    assert results["small"].ok
    assert fresh_sim.stats()["received"] == 1


def test_the_providers_request_too_large_is_not_retried_as_a_rate_limit(fresh_sim):
    fresh_sim.configure(tpm=1500)  # the provider's limit; the resource was told none
    results, _ = run_engine(make(fresh_sim), [ChatRequest("big", user("word " * 2000))])
    r = results["big"]
    assert r.error_class == "request_too_large" and r.attempts == 1 and r.http_429 == 0


def test_a_deterministic_500_trips_the_breaker_instead_of_retrying_every_row(fresh_sim):
    fresh_sim.configure(fail_param="response_format")
    llm = make(fresh_sim, max_concurrency=4, params={"response_format": {"type": "json_object"}})
    results, engine = run_engine(llm, [ChatRequest(i, user(f"r{i}")) for i in range(40)])
    assert "server_error" in engine.aborted_reason and "HTTP 500" in engine.aborted_reason
    assert sum(r.error_class == "aborted" for r in results.values()) >= 30
    # On main: 6 attempts x 40 rows = 240 requests. Here the rows in flight keep their retries
    # (a 5xx may be transient) and the 5th row with the same error stops the run.
    assert fresh_sim.stats()["received"] <= 40


def test_rows_stopped_by_the_breaker_keep_their_first_real_error(fresh_sim):
    # Why (issue 28): 13 of 20 failed rows read `aborted` although they had been sent and had
    # failed with a real error before the run stopped.
    fresh_sim.configure(fail_param="response_format")
    llm = make(fresh_sim, max_concurrency=4, params={"response_format": {"type": "json_object"}})
    results, engine = run_engine(llm, [ChatRequest(i, user(f"r{i}")) for i in range(40)])
    assert engine.aborted_reason
    sent = [r for r in results.values() if r.attempts > 0]
    unsent = [r for r in results.values() if r.attempts == 0]
    assert sent and unsent
    assert all(r.error_class == "server_error" and "HTTP 500" in r.error_message for r in sent)
    assert all(r.error_class == "aborted" for r in unsent)
    assert all(r.error_message.startswith("aborted: the run stopped after ") for r in unsent)


def test_transient_500s_keep_their_retries(fresh_sim):
    fresh_sim.configure(fail_500=0.3, seed=3)
    results, engine = run_engine(
        make(fresh_sim, max_concurrency=4, max_attempts=8),
        [ChatRequest(i, user(f"t{i}")) for i in range(60)],
    )
    assert engine.aborted_reason is None
    assert all(r.ok for r in results.values())


def test_the_same_400_on_consecutive_rows_stops_the_run(fresh_sim):
    llm = make(fresh_sim, max_concurrency=1, params={"temperature": 7})
    results, engine = run_engine(llm, [ChatRequest(i, user(f"b{i}")) for i in range(30)])
    assert "5 consecutive rows" in engine.aborted_reason and "temperature" in engine.aborted_reason
    assert fresh_sim.stats()["received"] == 5
    assert sum(r.error_class == "bad_request" for r in results.values()) == 5


def test_the_retry_budget_bounds_the_runs_retries(fresh_sim):
    fresh_sim.configure(drop=1.0)  # every request dropped: connection errors, no status
    settings = EngineSettings(
        model="sim-1", max_concurrency=2, retry_budget_base=3, retry_budget_ratio=0.0
    )

    async def main():
        transport = AiohttpTransport(base_url=fresh_sim.url, api_key=SIM_KEY, model="sim-1")
        engine = Engine(settings, transport)
        try:
            return [r async for r in engine.map(ChatRequest(i, user("x")) for i in range(10))]
        finally:
            await transport.aclose()

    results = asyncio.run(main())
    # Each row's retry the budget refused says so in its class (it kept the last attempt's
    # class before), and its message keeps the error it could not retry.
    assert {r.error_class for r in results} == {"retry_budget_exhausted"}
    assert fresh_sim.stats()["received"] == 10 + 3
    assert all("retry budget" in r.error_message for r in results)
    assert all(
        "ClientOSError" in r.error_message
        or "Disconnected" in r.error_message
        or "connection" in r.error_message.lower()
        for r in results
    )


def test_a_deadline_that_passes_during_a_shared_pause_is_not_sent(fresh_sim, valkey_url):
    llm = make(fresh_sim, rpm=6000, redis_url=valkey_url, job_key="pause-deadline")

    async def main():
        async with llm.engine() as engine:
            # A 429's exact hint, just seen: every process pauses a second.
            await engine.limiter.penalize(Grant(0.0), retry_after_s=1.0)
            req = ChatRequest(1, user("x"), deadline=time.monotonic() + 0.3)
            return await engine.run_one(req)

    with llm:
        r = asyncio.run(main())
    assert r.error_class == "deadline_exceeded" and r.attempts == 0
    assert fresh_sim.stats().get("received", 0) == 0


# -- provider profiles and usage -------------------------------------------------------------


def test_a_reasoning_model_gets_max_completion_tokens_from_the_start(fresh_sim):
    fresh_sim.configure(reasoning=True, models={"sim-1": 16_384, "gpt-5-mini": 400_000})
    results, engine = run_engine(
        make(fresh_sim, model="gpt-5-mini"), [ChatRequest(i, user(f"g{i}")) for i in range(5)]
    )
    assert all(r.ok for r in results.values())
    assert engine.token_param.name == "max_completion_tokens" and not engine.token_param.switched
    assert fresh_sim.stats().get("unsupported_parameter", 0) == 0


def test_a_model_that_rejects_max_tokens_is_switched_once(fresh_sim, caplog):
    fresh_sim.configure(reasoning=True)
    with caplog.at_level(logging.WARNING):
        results, engine = run_engine(
            make(fresh_sim, max_concurrency=1), [ChatRequest(i, user(f"s{i}")) for i in range(8)]
        )
    assert all(r.ok for r in results.values())
    assert engine.token_param.switched and engine.token_param.name == "max_completion_tokens"
    assert fresh_sim.stats()["unsupported_parameter"] == 1
    assert caplog.text.count("rejects max_tokens") == 1


def test_input_output_usage_is_read(fresh_sim):
    fresh_sim.configure(usage_shape="input_output")
    results, _ = run_engine(make(fresh_sim), [ChatRequest(1, user("Stocks rally"))])
    r = results[1]
    assert r.ok and r.prompt_tokens > 0 and r.completion_tokens > 0 and not r.tokens_estimated


def test_missing_usage_records_the_estimate_flagged_and_warns_once(fresh_sim, caplog):
    fresh_sim.configure(usage_shape="none")
    with caplog.at_level(logging.WARNING):
        results, _ = run_engine(
            make(fresh_sim, estimate_margin=0.0), [ChatRequest(i, user("Rates")) for i in range(6)]
        )
    for r in results.values():
        assert r.ok and r.tokens_estimated and r.prompt_tokens > 0 and r.completion_tokens > 0
    assert caplog.text.count("sent no token usage") == 1


def test_a_model_tiktoken_does_not_know_is_reserved_with_a_margin_and_a_warning(fresh_sim, caplog):
    # tiktoken falls back to o200k for a model it does not know (a self-hosted Llama, Qwen), whose
    # own tokenizer can count digit-heavy text at twice as many tokens: the reservation (and
    # the context check) must not take the fallback's count as exact, nor say nothing.
    text = "Q3 revenue 1234567.89 against 987654.32, margin 12.5% " * 10
    params = {"max_tokens": 30}
    with caplog.at_level(logging.WARNING):
        unknown, _ = run_engine(make(fresh_sim, params=params), [ChatRequest(1, user(text))])
        known, _ = run_engine(
            make(fresh_sim, model="gpt-4o-mini", params=params), [ChatRequest(1, user(text))]
        )
    assert caplog.text.count("tiktoken does not know model 'sim-1'") == 1
    assert "gpt-4o-mini" not in caplog.text
    prompt = known[1].estimated_tokens - 30  # the same encoding, o200k, without the margin
    assert unknown[1].estimated_tokens - 30 == math.ceil(prompt * (1 + FALLBACK_ESTIMATE_MARGIN))


def test_the_context_window_is_asked_of_a_self_hosted_server(fresh_sim):
    fresh_sim.configure(models={"sim-1": 300, "gpt-4o-mini": 128_000})
    results, engine = run_engine(
        make(fresh_sim), [ChatRequest("long", user("word " * 400)), ChatRequest("ok", user("hi"))]
    )
    assert engine.s.context_window == 300
    assert results["long"].error_class == "context_length" and results["long"].attempts == 0
    assert results["ok"].ok and fresh_sim.stats()["received"] == 1


# -- the provider's rate-limit headers ----------------------------------------------------


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


# -- Redis --------------------------------------------------------------------------------------


def test_a_wrong_redis_port_fails_the_run_within_seconds(fresh_sim):
    llm = make(fresh_sim, rpm=600, redis_url="redis://127.0.0.1:1/0")
    started = time.monotonic()
    with pytest.raises(E.LimiterUnavailableError, match=r"could not be reached.*port"):
        run_engine(llm, [ChatRequest(1, user("x"))])
    assert time.monotonic() - started < 10
    assert fresh_sim.stats().get("received", 0) == 0


def test_a_wrong_redis_password_fails_the_run_with_a_clear_message(fresh_sim):
    with EmbeddedValkey() as server:
        redis.Redis.from_url(server.url).config_set("requirepass", "the-password")
        url = server.url.replace("redis://", "redis://default:not-the-password@")
        llm = make(fresh_sim, rpm=600, redis_url=url)
        started = time.monotonic()
        with pytest.raises(E.LimiterAuthError) as info:
            run_engine(llm, [ChatRequest(1, user("x"))])
    assert time.monotonic() - started < 10
    assert "not-the-password" not in str(info.value)
    assert "refused the credentials" in str(info.value)
    assert fresh_sim.stats().get("received", 0) == 0


def test_redis_response_errors_fail_rows_with_a_reason_not_a_dead_worker(fresh_sim):
    """A real Valkey made read-only (a replica after a failover) and one out of memory. redis-py
    strips the READONLY code from the message: the limiter tells it by its class."""
    with EmbeddedValkey() as primary, EmbeddedValkey() as replica:
        host, port = primary.url.removeprefix("redis://").split("/")[0].split(":")
        r = redis.Redis.from_url(replica.url)
        r.execute_command("REPLICAOF", host, port)
        time.sleep(0.5)

        async def main(url, outage_s):
            client = aioredis.Redis.from_url(url)
            await check_redis(client, url)
            settings = LimiterSettings(rpm=600, outage_s=outage_s)
            limiter = RedisLimiter(client, namespace="t:{ro}", settings=settings)
            transport = AiohttpTransport(base_url=fresh_sim.url, api_key=SIM_KEY, model="sim-1")
            engine = Engine(EngineSettings(model="sim-1", max_concurrency=4), transport, limiter)
            try:
                reqs = (ChatRequest(i, user("x")) for i in range(12))
                return [res async for res in engine.map(reqs)]
            finally:
                await transport.aclose()
                await client.aclose()

        started = time.monotonic()
        results = asyncio.run(main(replica.url, 1.0))  # READONLY: retried, then the row fails
        assert len(results) == 12 and time.monotonic() - started < 20
        assert {x.error_class for x in results} == {"limiter_unavailable"}
        assert "ReadOnlyError" in results[0].error_message
        assert "gave up after 1 s" in results[0].error_message

        # The failover completes (the replica is promoted) while the rows wait it out: they go.
        timer = threading.Timer(1.0, lambda: r.execute_command("REPLICAOF", "NO", "ONE"))
        timer.start()
        results = asyncio.run(main(replica.url, 30.0))
        timer.join()
        assert [x.error_message for x in results if not x.ok] == []

        p = redis.Redis.from_url(primary.url)
        p.config_set("maxmemory-policy", "noeviction")
        p.config_set("maxmemory", "1")
        started = time.monotonic()
        results = asyncio.run(main(primary.url, 30.0))  # OOM: fails at once, with the reason
        assert time.monotonic() - started < 10
        assert len(results) == 12 and {x.error_class for x in results} == {"limiter_error"}
        assert "OutOfMemoryError" in results[0].error_message


# -- parsing, profiles and small parts (no server needed) ---------------------------------------


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


def test_usage_in_every_shape():
    from batch_llm_assets.engine.usage import parse_usage

    openai = {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 3},
    }
    u = parse_usage(openai)
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.reasoning_tokens) == (
        10,
        5,
        4,
        3,
    )
    u = parse_usage({"input_tokens": 7, "output_tokens": 2, "cache_read_input_tokens": 1})
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (7, 2, 1)
    assert parse_usage({"prompt_tokens": 9, "total_tokens": 12}).completion_tokens == 3
    assert parse_usage(None) is None and parse_usage({}) is None


def test_providers_are_told_apart_by_their_url():
    from batch_llm_assets.engine.profiles import detect_provider, profile_for, token_param_for

    assert detect_provider("https://api.openai.com/v1") == "openai"
    assert detect_provider("https://x.openai.azure.com") == "azure"
    assert detect_provider("https://any", api_version="2024-10-21") == "azure"
    g = "https://generativelanguage.googleapis.com/v1beta/openai"
    assert detect_provider(g) == "gemini"
    # Any other server is asked what it is (test_server_detect.py): its port says nothing.
    for url in ("http://localhost:8000/v1", "http://localhost:8080/v1", "http://vllm:11434/v1"):
        assert detect_provider(url) == "generic"
    local = profile_for("llamacpp", "http://localhost:8000/v1")
    assert local.max_concurrency <= 8 and local.request_timeout_s >= 300
    with pytest.raises(ValueError, match="unknown provider 'bedrock'"):
        profile_for("bedrock", "")
    for model in ("gpt-5", "gpt-5-mini", "o1-preview", "o3", "o4-mini", "openai/gpt-5"):
        assert token_param_for(model) == "max_completion_tokens"
    assert token_param_for("gpt-4o-mini") == token_param_for("llama-3") == "max_tokens"


def test_a_resource_takes_its_profile_defaults():
    llm = LLMResource(base_url="http://localhost:11434/v1", model="llama3", provider="ollama")
    assert llm.profile.name == "llamacpp" and llm.concurrency == 4
    assert llm.engine_settings().request_timeout_s == 600
    assert LLMResource(provider="llama-cpp-python").profile.name == "llamacpp"
    # Not yet asked, a server that is not a hosted API has the generic profile.
    assert LLMResource(base_url="http://localhost:11434/v1").profile.name == "generic"
    with pytest.raises(Exception, match="unknown provider"):
        LLMResource(provider="nope")


@pytest.mark.parametrize(
    "payload",
    [
        {"data": [{"id": "m", "max_model_len": 8192}]},  # vLLM
        {"data": [{"id": "m", "meta": {"n_ctx_train": 1, "n_ctx": 8192}}]},  # llama.cpp
        {"data": [{"id": "m", "context_length": 8192}]},  # OpenRouter, LM Studio
    ],
)
def test_context_windows_in_the_shapes_servers_send(payload):
    from batch_llm_assets.engine.profiles import context_window_from_models

    assert context_window_from_models(payload, "m") == 8192
    assert context_window_from_models({"data": []}, "m") is None


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


def test_limiter_warnings_are_one_line_per_kind_per_period(caplog):
    from batch_llm_assets.engine.redis_client import Warnings

    warn = Warnings(every_s=10)
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            warn("ConnectionError", "Limiter Redis unavailable (%s); retrying.", "x")
        warn("ResponseError", "other kind")
    assert caplog.text.count("Limiter Redis unavailable") == 1
    assert caplog.text.count("other kind") == 1


def test_a_cluster_url_makes_a_cluster_client():
    # No Redis Cluster runs here (it needs 3+ nodes): only which client the URL selects.
    from batch_llm_assets.engine.limiter import connect_redis

    assert isinstance(connect_redis("redis+cluster://127.0.0.1:7000/0"), aioredis.RedisCluster)
    assert isinstance(connect_redis("redis://127.0.0.1:6379/0"), aioredis.Redis)


def test_error_signatures_ignore_ids_and_numbers():
    a = E.ProviderError("server_error", "HTTP 500: failed req_abc123 at 17:02", status=500)
    b = E.ProviderError("server_error", "HTTP 500: failed req_zzz999 at 18:44", status=500)
    c = E.ProviderError("server_error", "HTTP 500: other", status=500)
    assert a.signature == b.signature != c.signature


def test_a_provider_that_counts_otherwise_is_reserved_what_it_charges(fresh_sim, valkey_url):
    # The provider counts a quarter of the body's characters (~1.7x tiktoken here): the engine
    # learns it from the usage and reserves that, so its 1 s bucket is never overdrawn.
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
    # One 429 in about one run in six: when the burst widens (0.5 s to the bucket's 0.9 s) the
    # schedule restarts from what the answer says remains less what was sent since, and a
    # request granted just before but not yet sent is in neither (docs/engine.md, Known
    # limits). Without the calibration it is a 429 storm, every request 1.3x underreserved.
    assert fresh_sim.stats().get("rate_limited", 0) <= 1
    assert engine.pacer.controller.calibration > 1.3
