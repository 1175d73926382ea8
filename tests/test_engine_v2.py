"""Engine v2 against the simulator over real HTTP and a real Valkey: error semantics (out of
credit, too large, the breaker, the retry budget, deadlines), provider profiles, usage and
context windows, and a hardened Redis limiter. The provider's rate-limit headers are in
test_engine_headers.py, the parts that need no server in test_engine_parts.py."""

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
