"""A self-hosted server's concurrency found instead of assumed (issue 29): the simulator as a
server with N decode slots and a queue (over real HTTP), the adaptive limit growing toward its
slots and backing off when it queues, shared through a real Redis by two engines, a killed
holder's slots coming back, no answer abandoned by a timeout, hosted APIs as before.

Every check counts events (the simulator's own counters, the gate's), never wall time."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import textwrap

import aiohttp
import pydantic
import pytest
import redis.asyncio as aioredis

from batch_llm_assets import ChatRequest, LLMResource
from batch_llm_assets.engine import Engine, EngineSettings
from batch_llm_assets.engine import _constants as C
from batch_llm_assets.engine.adaptive import Limit, Window, next_limit
from batch_llm_assets.engine.gate import ConcurrencyGate
from batch_llm_assets.engine.transport import AiohttpTransport
from batch_llm_assets.simulator import SimulatorProcess


@pytest.fixture(scope="module")
def server():
    """A simulator of its own: these tests give it decode slots the shared one must not keep."""
    with SimulatorProcess(latency_ms=20, latency_per_token_ms=0, jitter=0.1) as sim:
        yield sim


@pytest.fixture
def slots(server):
    """The server with `decode_slots` (and other settings), counters zeroed."""

    def configure(**settings):
        base = {"decode_slots": 0, "latency_ms": 20.0, "jitter": 0.1, "rpm": None}
        server.configure(**(base | settings))
        server.reset()
        return server

    return configure


def rows(n: int, offset: int = 0) -> list[ChatRequest]:
    return [
        ChatRequest(offset + i, [{"role": "user", "content": f"row {offset + i}"}])
        for i in range(n)
    ]


def run(resource: LLMResource, requests) -> tuple[list, Engine]:
    async def main():
        async with resource.engine() as engine:
            return [r async for r in engine.map(requests)], engine

    with resource:
        return asyncio.run(main())


def local(server, **kw) -> LLMResource:
    """A resource on the simulator: a port that names no provider, the generic profile (not
    hosted): an adaptive limit by default."""
    return LLMResource(base_url=server.url, model="sim-1", context_window=16_384, **kw)


def test_limit_grows_from_one_toward_the_servers_slots(slots):
    server = slots(decode_slots=4)
    results, engine = run(local(server, max_concurrency=32), rows(120))
    assert all(r.ok for r in results)
    gate = engine.gate
    assert gate is not None and gate.grown >= 2
    assert gate.peak_limit >= 4  # it reached the server's slots
    assert server.stats()["max_decoding"] == 4  # and kept them all busy


def test_limit_backs_off_when_the_server_queues(slots):
    server = slots(decode_slots=2)
    results, engine = run(local(server, max_concurrency=32), rows(120))
    assert all(r.ok for r in results)
    gate = engine.gate
    assert gate.shrunk >= 1  # latency climbed past the tolerance: it backed off
    stats = server.stats()
    assert stats["max_concurrent"] < 32  # never the whole max_concurrency queued at the server
    assert stats["max_concurrent"] <= gate.peak_limit


def test_limit_never_exceeds_max_concurrency(slots):
    server = slots(decode_slots=0)  # no queue: latency holds at any concurrency
    results, engine = run(local(server, max_concurrency=6), rows(150))
    assert all(r.ok for r in results)
    assert engine.gate.peak_limit == 6
    assert engine.gate.peak_inflight <= 6
    assert server.stats()["max_concurrent"] <= 6


def test_a_slow_servers_queued_requests_are_not_abandoned(slots):
    """One decode slot, 100 ms a request, a 0.5 s timeout: with 8 in flight the last ones wait
    past their timeout, are given up while the server computes them anyway, and are sent again.
    The adaptive limit and its raised timeout give up none."""
    server = slots(decode_slots=1, latency_ms=100.0, jitter=0.0)
    settings = {"max_concurrency": 8, "request_timeout_s": 0.5, "max_attempts": 3}
    run(local(server, adaptive_concurrency=False, **settings), rows(16))
    assert server.stats()["abandoned_answers"] > 0  # what a fixed 8 in flight does here

    server.reset()
    results, _ = run(local(server, **settings), rows(16, offset=100))
    assert all(r.ok for r in results)
    assert all(r.attempts == 1 for r in results)
    stats = server.stats()
    assert stats["abandoned_answers"] == 0
    assert stats["answered"] == 16


def test_a_timeout_shorter_than_the_queue_is_raised_not_given_up(slots):
    """Three slots, 100 ms a request, a 0.25 s timeout. While latency holds the limit doubles
    to 8, where a request may wait 0.2 s in the server's queue: with the configured timeout it
    would be given up and computed for nobody; raised from the latency seen, it waits."""
    server = slots(decode_slots=3, latency_ms=100.0, jitter=0.0)
    settings = {"max_concurrency": 8, "request_timeout_s": 0.25, "max_attempts": 3}
    results, _ = run(local(server, **settings), rows(40))
    assert all(r.ok and r.attempts == 1 for r in results)
    stats = server.stats()
    assert stats["max_concurrent"] > 6  # requests did wait 0.2 s in the server's queue
    assert stats["abandoned_answers"] == 0


def test_hosted_profile_keeps_the_fixed_cap(slots):
    server = slots(decode_slots=2, latency_ms=300.0)
    results, engine = run(local(server, provider="openai", max_concurrency=6), rows(12))
    assert all(r.ok for r in results)
    assert engine.gate is None
    assert server.stats()["max_concurrent"] == 6  # all six at once, as before


def test_rate_limit_headers_make_the_limit_fixed(slots):
    """A server that answers with x-ratelimit-* is a rate-limited endpoint: max_concurrency."""
    server = slots(decode_slots=2, latency_ms=200.0, rpm=600_000)
    results, engine = run(local(server, max_concurrency=6), rows(12))
    assert all(r.ok for r in results)
    assert engine.gate.adaptive is False
    assert server.stats()["max_concurrent"] == 6


def _engine(server, gate: ConcurrencyGate) -> Engine:
    transport = AiohttpTransport(base_url=server.url, api_key="", model="sim-1")
    settings = EngineSettings(model="sim-1", max_concurrency=gate.max, context_window=16_384)
    return Engine(settings, transport, gate=gate)


def test_two_engines_on_one_redis_key_split_the_server(slots, redis_url, namespace):
    server = slots(decode_slots=0, latency_ms=30.0)

    async def one(client, offset):
        gate = ConcurrencyGate(max_concurrency=6, client=client, namespace=namespace)
        engine = _engine(server, gate)
        try:
            return [r async for r in engine.map(rows(150, offset))], gate
        finally:
            await gate.close()
            await engine.transport.aclose()

    async def main():
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await asyncio.gather(one(client, 0), one(client, 1000))
        finally:
            await client.aclose()

    (a, gate_a), (b, gate_b) = asyncio.run(main())
    assert all(r.ok for r in a + b)
    assert gate_a.peak_inflight >= 1 and gate_b.peak_inflight >= 1
    assert gate_a.refused + gate_b.refused > 0  # the shared limit held one back
    # Each alone would keep up to 6 in flight (12 together); shared, the server saw at most 6.
    assert server.stats()["max_concurrent"] <= 6


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def test_a_gate_closes_when_its_heartbeats_cancel_is_lost_inside_a_redis_call(valkey_url):
    """Closing stops the lease's heartbeat. A cancel that meets it inside a Redis call is lost
    (redis-py sends through Python 3.11's wait_for, which can drop it: cancel.py): the heartbeat
    then renewed the lease for ever, and close(), a run's last step, never returned (CI hung
    on it once). A 3 ms lease keeps the heartbeat inside Redis calls; the first close hung on
    every try before the fix."""

    async def main():
        client = aioredis.Redis.from_url(valkey_url)
        try:
            for i in range(20):
                gate = ConcurrencyGate(
                    max_concurrency=4, client=client, namespace=f"t:{{close-{i}}}", lease_ms=3
                )
                await gate.acquire()  # starts the heartbeat
                await asyncio.sleep(0.001 * (i % 10))
                closing = asyncio.ensure_future(gate.close())
                done, _ = await asyncio.wait({closing}, timeout=10)  # a bound, not a timing
                assert done, f"close {i} never returned"
        finally:
            await client.aclose()

    asyncio.run(main())


_HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    import redis.asyncio as aioredis
    from batch_llm_assets.engine.gate import ConcurrencyGate

    async def main(url, namespace):
        client = aioredis.Redis.from_url(url)
        gate = ConcurrencyGate(max_concurrency=4, client=client, namespace=namespace,
                               lease_ms=1000, start=4)
        for _ in range(4):
            await gate.acquire()
        print("held", gate.inflight, flush=True)
        await asyncio.Event().wait()  # holds them (its heartbeat renews the lease) until killed

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def test_a_killed_holders_slots_come_back(redis_url, namespace):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, redis_url, namespace], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().split() == ["held", "4"]

        async def main():
            client = aioredis.Redis.from_url(redis_url)
            gate = ConcurrencyGate(
                max_concurrency=4, client=client, namespace=namespace, lease_ms=1000, start=4
            )
            try:
                took = asyncio.gather(*(gate.acquire() for _ in range(4)))
                await asyncio.wait_for(_until(lambda: gate.refused >= 3), timeout=60)
                assert gate.inflight == 0  # asked, and refused: the holder has every slot
                holder.kill()  # SIGKILL: no release, no leave
                await asyncio.wait_for(took, timeout=60)  # a bound, not a timing assertion
                return gate.inflight
            finally:
                await gate.close()
                await client.aclose()

        assert asyncio.run(main()) == 4
    finally:
        holder.kill()
        holder.wait(timeout=10)
        holder.stdout.close()


@pytest.mark.parametrize("bad", [0, -1, math.nan, True, 2.5, "4"])
def test_max_concurrency_must_be_a_whole_number_of_at_least_one(bad):
    with pytest.raises(ValueError, match="max_concurrency must be a whole number >= 1"):
        EngineSettings(model="sim-1", max_concurrency=bad)
    with pytest.raises(ValueError, match="max_concurrency must be a whole number >= 1"):
        ConcurrencyGate(max_concurrency=bad)


@pytest.mark.parametrize("bad", [0, -1, math.nan, 2.5])
def test_resource_refuses_a_bad_max_concurrency(bad):
    with pytest.raises(pydantic.ValidationError, match="max_concurrency"):
        LLMResource(base_url="http://127.0.0.1:9/v1", max_concurrency=bad)


@pytest.mark.parametrize(
    "setting", [{"decode_slots": -1}, {"decode_slots": True}, {"decode_slowdown": math.nan}]
)
def test_simulator_refuses_bad_decode_settings(server, setting):
    with pytest.raises(Exception, match="400"):
        server.configure(**setting)


def test_a_client_that_gives_up_is_an_abandoned_answer(slots):
    """Queued or decoding, the server computes it anyway (llama.cpp's non-streamed requests)."""
    server = slots(decode_slots=1, latency_ms=200.0, jitter=0.0)

    async def main():
        timeout = aiohttp.ClientTimeout(total=0.1)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def ask(i):
                body = {"model": "sim-1", "messages": [{"role": "user", "content": f"q{i}"}]}
                try:
                    async with session.post(server.url + "/chat/completions", json=body) as r:
                        await r.read()
                except TimeoutError:
                    return "gave up"

            return await asyncio.gather(*(ask(i) for i in range(3)))

    assert asyncio.run(main()) == ["gave up"] * 3
    stats = server.stats()
    assert stats["abandoned_answers"] == 3
    assert stats["max_concurrent"] == 3 and stats["max_decoding"] == 1


def test_rows_that_got_slower_are_not_taken_for_a_queue():
    """The rule alone (no server): at a limit of 1 every answer takes 3x the base (the rows got
    longer); after ADAPTIVE_REBASE_WINDOWS windows that latency is the base and the limit
    grows again, where a fixed minimum would hold it at 1 for ever."""
    window = Window()
    state = Limit(1.0, base_s=0.1, growing=False)
    seen = []
    for _ in range(C.ADAPTIVE_REBASE_WINDOWS + 2):
        window.filled = True
        for _ in range(C.ADAPTIVE_WINDOW_MIN):
            window.add(window.since, 0.3)
        state = window.decide(state, max_limit=16)
        seen.append(state.value)
    assert state.base_s == pytest.approx(0.3)
    assert seen[-1] > 1


def test_growth_needs_a_full_limit_and_stops_at_the_maximum():
    cur = Limit(4.0, base_s=0.1, growing=True)
    assert next_limit(cur, rtt_s=0.1, filled=False, max_limit=64).value == 4
    assert next_limit(cur, rtt_s=0.1, filled=True, max_limit=64).value == 8
    assert next_limit(cur, rtt_s=0.1, filled=True, max_limit=6).value == 6
    assert next_limit(cur, rtt_s=0.4, filled=True, max_limit=64).value == 2
