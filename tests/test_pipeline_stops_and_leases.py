"""Stopping a partition run, and one run per partition: the result stream ending early (a
consumer that raises, closes, is cancelled or stops reading) and releasing the limiter's lease,
SIGTERM ending a run within seconds (keeping every answer, giving the key's share back, while a
template spins); a second run of a partition refused before it touches the first one's journal,
and the lease lapsing when its holder is killed. Helpers and fixtures are test_pipeline.py's."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import redis

from batch_llm_assets import ChatRequest, DuckDBWarehouse
from batch_llm_assets.assets.journal import journal_key
from batch_llm_assets.assets.lease import file_lease, redis_lease
from batch_llm_assets.engine.limiter import limiter_namespace

from .conftest import SIM_KEY, materialize_argv
from .conftest import duckdb_query as query
from .test_pipeline import (
    PK,
    _empty_journal,  # noqa: F401  (fixture)
    _journal_dir,
    db,  # noqa: F401  (fixture)
    failure,
    llm,
    run,
)

# -- the result stream is cancel-safe ----------------------------------------------------------


def _requests(n):
    return [ChatRequest(i, [{"role": "user", "content": f"row {i}"}]) for i in range(n)]


@pytest.mark.parametrize("how", ["raise", "aclose", "cancel", "full_queue"])
def test_the_result_stream_ends_promptly_and_releases_the_lease(fresh_sim, valkey_url, how):
    fresh_sim.configure(latency_ms=30.0)
    resource = llm(
        fresh_sim, rpm=100_000, redis_url=valkey_url, job_key=f"stop-{how}", max_concurrency=8
    )

    async def consume():
        got = 0
        stream = resource.chat_batch(_requests(2000))
        if how == "aclose":
            async for _ in stream:
                got += 1
                if got == 5:
                    break
            await stream.aclose()
            return got
        if how == "cancel":
            task = asyncio.create_task(_drain(stream))
            await asyncio.sleep(0.5)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return got
        async for _ in stream:
            got += 1
            if how == "full_queue":
                await asyncio.sleep(1.0)  # workers fill the bounded queue and block on it
            if got == 3:
                raise ValueError("the consumer died")
        return got

    started = time.monotonic()
    if how in ("raise", "full_queue"):
        with pytest.raises(ValueError, match="the consumer died"):
            asyncio.run(asyncio.wait_for(consume(), 30))
    else:
        asyncio.run(asyncio.wait_for(consume(), 30))
    assert time.monotonic() - started < 10
    received = fresh_sim.stats()["received"]
    time.sleep(0.5)
    assert fresh_sim.stats()["received"] == received < 2000  # nothing sent after the end
    ns = limiter_namespace(resource.base_url, resource.model, resource.api_key)
    assert redis.Redis.from_url(valkey_url).zcard(f"{ns}:leases") == 0


async def _drain(stream):
    async for _ in stream:
        pass


def _defs(
    tmp_path,
    sim,
    db,  # noqa: F811
    template="{{ headline }} Answer with one of: up, down",
    llm_kw: dict | None = None,
    **asset_kw,
):
    code = f"""
import dagster as dg
from batch_llm_assets import DuckDBWarehouse, LLMResource, Prompt, SourceTable, build_llm_batch_asset

sentiment = build_llm_batch_asset(
    name="sentiment",
    source=SourceTable(table="news_headlines", partition_column="published_at", columns=["headline"]),
    prompt=Prompt(template={template!r}),
    output="news_sentiment",
    partitions_def=dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04"),
    chunk_rows=50, **{asset_kw!r},
)
defs = dg.Definitions(assets=[sentiment], resources={{
    "llm": LLMResource(base_url="{sim.url}", api_key="{SIM_KEY}", model="gpt-4o-mini",
                       max_concurrency=8, **{llm_kw or {}!r}),
    "warehouse": DuckDBWarehouse(database="{db}"),
}})
"""
    path = tmp_path / "defs.py"
    path.write_text(code)
    return materialize_argv(path, tmp_path / "home", select="sentiment", partition=PK)


def _sigterm_after(proc, condition, timeout=120) -> float:
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        assert proc.poll() is None, "the run ended before it could be stopped"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # what Dagster's run termination sends
    started = time.monotonic()
    proc.wait(timeout=60)
    return time.monotonic() - started


def test_sigterm_ends_the_run_within_seconds_and_keeps_every_answer(fresh_sim, db, tmp_path):  # noqa: F811
    # 1,000 rows at 8 in flight and 100 ms each take 12.5 s: the stop after 200 comes before
    # the end even if a busy host delays the poll or the signal by seconds (at 40 ms, a CI run
    # on three workers once answered all 1,000 first).
    fresh_sim.configure(latency_ms=100.0)
    cmd, env = _defs(tmp_path, fresh_sim, db)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    took = _sigterm_after(proc, lambda: fresh_sim.stats().get("answered", 0) >= 200)
    assert took < 10 and proc.returncode != 0
    time.sleep(0.3)
    answered = fresh_sim.stats()["answered"]
    assert answered < 1000
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    assert query(db, "SELECT count(*), count(DISTINCT id) FROM news_sentiment") == [(1000, 1000)]
    assert fresh_sim.stats()["answered"] - 1000 <= 8  # journaled answers were not paid twice


def test_a_run_stopped_by_sigterm_gives_its_share_of_the_key_back_at_once(
    fresh_sim,
    db,  # noqa: F811
    tmp_path,
    valkey_url,
    fresh_limiter_state,
):
    """Dagster's run termination (SIGTERM) while the run is paced by the shared limiter: the
    run's lease goes as it stops, so another job on the key gets the whole limit at once, not
    when the lease lapses (JOB_LEASE_TTL_MS later)."""
    fresh_sim.configure(latency_ms=40.0)
    limited = {"rpm": 600, "redis_url": valkey_url, "job_key": "team-a"}
    cmd, env = _defs(tmp_path, fresh_sim, db, llm_kw=limited)
    ns = limiter_namespace(fresh_sim.url, "gpt-4o-mini", SIM_KEY)
    r = redis.Redis.from_url(valkey_url, decode_responses=True)

    def leased() -> list[str]:
        return [m for m in r.zrange(f"{ns}:leases", 0, -1) if m.startswith("team-a|")]

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _sigterm_after(proc, lambda: fresh_sim.stats().get("answered", 0) >= 20 and leased())
    assert proc.returncode != 0
    assert fresh_sim.stats()["answered"] < 1000  # stopped while paced, not after the work
    assert leased() == []
    assert r.hget(f"{ns}:jobs", "w:team-a") is None


def _cpu_s(proc: psutil.Popen) -> float:
    """CPU seconds used by `proc`'s children (Dagster runs the step in one)."""
    total = 0.0
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += sum(child.cpu_times()[:2])
    return total


def test_sigterm_stops_a_run_while_a_template_spins(fresh_sim, db, tmp_path):  # noqa: F811
    spin = (
        "{% set x = range(100000)|list %}{% for a in x %}{% for b in x %}{% endfor %}{% endfor %}"
    )
    cmd, env = _defs(
        tmp_path, fresh_sim, db, template=spin + "{{ headline }}", render_timeout_s=600
    )
    proc = psutil.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []  # read as it comes: a full pipe would block the run
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    started: list[float] = []

    def spinning() -> bool:
        # Once the step has spun a CPU-second past its start, not after a fixed sleep: a SIGTERM
        # that reaches Dagster while it launches the step's process is not forwarded to it (its
        # multiprocess executor stops only the children it has started), and the step would
        # then render for 600 s. A CI run on a busy host sent it there once.
        if not started and any("STEP_START" in line for line in lines):
            started.append(_cpu_s(proc))
        return bool(started) and _cpu_s(proc) - started[0] >= 1.0

    took = _sigterm_after(proc, spinning)
    # Not the render's 600 s: 1.6 s alone, 12 s beside six busy processes on two cores.
    assert took < 30
    assert fresh_sim.stats().get("received", 0) == 0


# -- one run per partition ------------------------------------------------------------------------


def _scope(db) -> str:  # noqa: F811
    return journal_key(f"{DuckDBWarehouse(database=db).identity()}|news_sentiment", PK)


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_a_second_run_of_a_partition_is_refused_and_the_first_journal_untouched(
    fresh_sim,
    db,  # noqa: F811
    valkey_url,
    backend,
):
    key = _scope(db)
    planted = _journal_dir() / f"{key}.00000001.jsonl"
    planted.write_text('{"id": 1, "status": "ok"}\n')
    holder = (
        file_lease(_journal_dir() / f"{key}.lock", "p", "run-A")
        if backend == "file"
        else redis_lease(valkey_url, key, "p", "run-A", ttl_s=5)
    )
    kw = {"redis_url": valkey_url} if backend == "redis" else {}
    with holder:
        result = run(db, fresh_sim, **kw)
    assert not result.success
    message = failure(result)
    assert "already being processed by run run-A" in message
    assert fresh_sim.stats().get("received", 0) == 0
    assert planted.read_text() == '{"id": 1, "status": "ok"}\n'
    assert query(
        db, "SELECT count(*) FROM information_schema.tables WHERE table_name = 'news_sentiment'"
    ) == [(0,)]


_HOLD = """
import sys, time
from pathlib import Path
from batch_llm_assets.assets.lease import file_lease, redis_lease
backend, where = sys.argv[1], sys.argv[2]
lease = file_lease(Path(where), "p", "run-K") if backend == "file" else redis_lease(where, "k", "p", "run-K", ttl_s=1.0)
with lease:
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_the_lease_lapses_when_its_holder_is_killed(tmp_path, valkey_url, backend):
    where = str(tmp_path / "k.lock") if backend == "file" else valkey_url
    if backend == "redis":
        redis.Redis.from_url(valkey_url).delete("batch_llm:partition_lease:k")
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, backend, where], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"held"

    def take():
        if backend == "file":
            return file_lease(Path(where), "p", "run-L")
        return redis_lease(where, "k", "p", "run-L", ttl_s=1.0)

    time.sleep(1.5)  # the holder renews: still held after more than one TTL
    with pytest.raises(Exception, match="run-K"), take():
        pass
    proc.kill()  # SIGKILL: no cleanup
    proc.wait()
    deadline = time.monotonic() + 5
    while True:
        try:
            with take():
                break
        except Exception:
            assert time.monotonic() < deadline, "the lease did not lapse"
            time.sleep(0.1)
