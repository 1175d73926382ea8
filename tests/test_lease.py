"""The partition lease on real processes and servers: two hosts on BigQuery without a shared Redis,
a holder killed with SIGKILL, a DuckDB file held by a long run. (Lease basics:
test_pipeline_stops_and_leases.py; its Redis restarted, failed over or given a password:
test_lease_redis.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import dagster as dg
import pytest
import redis

from batch_llm_assets import DuckDBWarehouse, LLMResource, Prompt, SourceTable
from batch_llm_assets import build_llm_batch_asset as build
from batch_llm_assets.demo_data import create_demo_table

from .conftest import SIM_KEY
from .conftest import duckdb_query as query
from .test_bigquery import PROJECT, bq, bq_endpoint, dataset, day_ids  # noqa: F401 (fixtures)
from .test_bigquery import query as bq_query

DAYS = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04")
PK = "2026-11-01"
STEP_TIMEOUT_S = 180  # any one subprocess step; the machine may be busy
KEY_PREFIX = "batch_llm:partition_lease:"

_DEFS = """
import dagster as dg
from batch_llm_assets import DuckDBWarehouse, LLMResource, Prompt, SourceTable
from batch_llm_assets import build_llm_batch_asset
from batch_llm_assets.resources.bigquery_warehouse import BigQueryWarehouse

sentiment = build_llm_batch_asset(
    name="sentiment",
    source=SourceTable(table={source!r}, partition_column="published_at", columns=["headline"]),
    prompt=Prompt(template="{{{{ headline }}}} Answer with one of: up, down"),
    output={output!r},
    params={{"max_tokens": 5}},
    partitions_def=dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04"),
    chunk_rows=8,
)
defs = dg.Definitions(
    assets=[sentiment],
    resources={{
        "llm": LLMResource(base_url={url!r}, api_key={key!r}, model="gpt-4o-mini",
                           max_concurrency=2, redis_url={redis_url!r}),
        "warehouse": {warehouse},
    }},
    executor=dg.in_process_executor,
)
"""


def host(tmp_path, name, sim, *, source, output, warehouse, redis_url=None):
    """A `dagster asset materialize` of partition PK as a host of its own would run it: its own
    code file, DAGSTER_HOME and journal dir. (argv, env)"""
    root = tmp_path / name
    (root / "home").mkdir(parents=True, exist_ok=True)
    defs = root / "defs.py"
    defs.write_text(
        _DEFS.format(
            source=source,
            output=output,
            url=sim.url,
            key=SIM_KEY,
            redis_url=redis_url,
            warehouse=warehouse,
        )
    )
    argv = [sys.executable, "-m", "dagster", "asset", "materialize", "-f", str(defs)]
    argv += ["--select", "sentiment", "--partition", PK]
    env = {
        **os.environ,
        "DAGSTER_HOME": str(root / "home"),
        "BATCH_LLM_JOURNAL_DIR": str(root / "journal"),
    }
    return argv, env


def bigquery_host(tmp_path, name, sim, endpoint, ds, **kw):
    warehouse = f"BigQueryWarehouse(project={PROJECT!r}, api_endpoint={endpoint!r})"
    return host(
        tmp_path,
        name,
        sim,
        source=f"{ds}.news_headlines",
        output=f"{ds}.news_sentiment",
        warehouse=warehouse,
        **kw,
    )


def duckdb_host(tmp_path, name, sim, db, **kw):
    warehouse = f"DuckDBWarehouse(database={db!r})"
    return host(
        tmp_path,
        name,
        sim,
        source="news_headlines",
        output="news_sentiment",
        warehouse=warehouse,
        **kw,
    )


def wait_for(what, check, proc=None, timeout_s=STEP_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert proc is None or proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def sent(sim) -> int:
    return sim.stats().get("received", 0)


# -- two hosts, one warehouse, no shared Redis ---------------------------------------------------
def test_two_hosts_on_bigquery_without_redis_one_pays_the_other_is_refused_at_once(
    fresh_sim,
    tmp_path,
    bq_endpoint,  # noqa: F811
    bq,  # noqa: F811
    dataset,  # noqa: F811
):
    """Two hosts (their own journal dirs, no redis_url) run one BigQuery partition: the lease is
    a row in BigQuery, so the second is refused, naming the first, and pays nothing (before: a
    file lock on each host, and both paid)."""
    rows = len(day_ids(PK))
    # The first host holds on until told (10 s an answer: 100 s for its 20 rows), however long
    # the second takes to start on a busy machine.
    fresh_sim.configure(latency_ms=10_000, jitter=0.0)
    argv_a, env_a = bigquery_host(tmp_path, "a", fresh_sim, bq_endpoint, dataset)
    argv_b, env_b = bigquery_host(tmp_path, "b", fresh_sim, bq_endpoint, dataset)
    log_a = tmp_path / "a.log"
    with open(log_a, "w") as out:
        first = subprocess.Popen(argv_a, env=env_a, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for("the first host's first request", lambda: sent(fresh_sim) >= 1, first)
        second = subprocess.run(
            argv_b, env=env_b, capture_output=True, text=True, timeout=STEP_TIMEOUT_S
        )
        assert first.poll() is None  # refused while the first held the partition, not after
        fresh_sim.configure(latency_ms=5.0)
        first.wait(timeout=STEP_TIMEOUT_S)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, log_a.read_text()[-3000:]
    assert second.returncode != 0
    assert "is already being processed by run " in second.stdout + second.stderr
    stats = fresh_sim.stats()
    assert stats["received"] == stats["answered"] == rows  # each row paid once
    table = f"`{dataset}`.`news_sentiment`"
    assert bq_query(bq, f"SELECT COUNT(*), COUNTIF(status = 'ok') FROM {table}") == [(rows, rows)]
    leases = bq_query(bq, f"SELECT COUNT(*) FROM `{dataset}`.`_batch_llm_leases`")
    assert leases == [(0,)]  # released at the end


# -- a holder killed with SIGKILL ----------------------------------------------------------------
def _outlive_the_relaunch_in_redis(url: str, pid: int) -> None:
    """The dead holder's lease key lives past the relaunch's step limit (its pid names it)."""
    r = redis.Redis.from_url(url)
    keys = [
        k for k in r.scan_iter(KEY_PREFIX + "*") if json.loads(r.get(k) or "{}").get("pid") == pid
    ]
    assert len(keys) == 1  # it held the lease when it was killed
    r.pexpire(keys[0], STEP_TIMEOUT_S * 1000)


def _outlive_the_relaunch_in_bigquery(client, ds: str) -> None:
    table = f"`{ds}`.`_batch_llm_leases`"
    assert bq_query(client, f"SELECT COUNT(*) FROM {table}") == [(1,)]
    bq_query(
        client,
        f"UPDATE {table} SET expires_at = "
        f"TIMESTAMP_ADD(CURRENT_TIMESTAMP(), INTERVAL {STEP_TIMEOUT_S} SECOND) WHERE TRUE",
    )


@pytest.mark.parametrize("backend", ["redis", "bigquery"])
def test_a_run_killed_with_sigkill_is_taken_over_at_once(
    fresh_sim,
    tmp_path,
    valkey_url,
    bq_endpoint,  # noqa: F811
    bq,  # noqa: F811
    dataset,  # noqa: F811
    backend,
):
    """The holder's process is gone (same machine: its pid is free), so the relaunch takes its
    lease at once instead of waiting out a TTL (30 s before in Redis; BigQuery's is 60 s).

    In lease terms: the dead holder's lease is made to outlive the relaunch's own time limit,
    so the relaunch can only get in by taking it over while it is live, never by its lapsing
    (a wall-clock bound on the relaunch would measure the host's load, not the lease)."""
    if backend == "redis":
        db = str(tmp_path / "kill.duckdb")
        create_demo_table(db, days=1, per_day=20)
        argv, env = duckdb_host(tmp_path, "h", fresh_sim, db, redis_url=valkey_url)
    else:
        argv, env = bigquery_host(tmp_path, "h", fresh_sim, bq_endpoint, dataset)
    fresh_sim.configure(latency_ms=300, jitter=0.0)
    victim = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        wait_for("a few answers", lambda: fresh_sim.stats().get("answered", 0) >= 3, victim)
    finally:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
    fresh_sim.configure(latency_ms=5.0)
    if backend == "redis":
        _outlive_the_relaunch_in_redis(valkey_url, victim.pid)
    else:
        _outlive_the_relaunch_in_bigquery(bq, dataset)
    started = time.monotonic()
    relaunch = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    assert relaunch.returncode == 0, (relaunch.stdout + relaunch.stderr)[-3000:]
    assert "taking over the lease of run " in relaunch.stdout + relaunch.stderr
    if backend == "redis":
        assert query(db, "SELECT count(*), min(status) FROM news_sentiment") == [(20, "ok")]
    else:
        table = f"`{dataset}`.`news_sentiment`"
        assert bq_query(bq, f"SELECT COUNT(*), MIN(status) FROM {table}") == [(20, "ok")]
    print({"backend": backend, "relaunch_s": round(time.monotonic() - started, 1)})


class InThread:
    """The partition run in this process, in a thread, the simulator holding each answer
    `latency_ms` until the test lets the run finish (`finish`, also on the way out)."""

    def __init__(self, sim, db, redis_url, *, latency_ms: float = 5000) -> None:
        self.sim = sim
        sim.configure(latency_ms=latency_ms, jitter=0.0)
        asset = build(
            name="sentiment",
            source=SourceTable(
                table="news_headlines", partition_column="published_at", columns=["headline"]
            ),
            prompt=Prompt(template="{{ headline }} Answer with one of: up, down"),
            output="news_sentiment",
            partitions_def=DAYS,
            chunk_rows=8,
        )
        llm = LLMResource(
            base_url=sim.url,
            api_key=SIM_KEY,
            model="gpt-4o-mini",
            max_concurrency=2,
            redis_url=redis_url,
        )
        resources = {"llm": llm, "warehouse": DuckDBWarehouse(database=db)}
        self.results: list[dg.ExecuteInProcessResult] = []
        self.thread = threading.Thread(
            target=lambda: self.results.append(
                dg.materialize([asset], partition_key=PK, raise_on_error=False, resources=resources)
            ),
            daemon=True,
        )

    def __enter__(self) -> InThread:
        self.thread.start()
        return self

    def finish(self) -> dg.ExecuteInProcessResult:
        self.sim.configure(latency_ms=5.0)
        self.thread.join(timeout=STEP_TIMEOUT_S)
        assert not self.thread.is_alive() and self.results
        return self.results[0]

    def __exit__(self, *exc: object) -> None:
        if self.thread.is_alive():
            self.finish()


def succeeded(result: dg.ExecuteInProcessResult) -> bool:
    if not result.success:
        pytest.fail(failure(result))
    return True


def failure(result: dg.ExecuteInProcessResult) -> str:
    return result.get_step_failure_events()[0].step_failure_data.error.message


def test_a_holder_is_dead_only_when_its_process_is_known_to_be_gone():
    """Taken over at once only when the holder ran on this machine and its process ended: its
    pid free, or another process's now (a later start time). Anything else waits for the TTL."""
    from batch_llm_assets.assets.lease import _process_start, holder_info, holder_is_dead

    me = holder_info("run-me")
    assert not holder_is_dead(me)  # alive
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = _process_start(child.pid)
    holder = {**me, "pid": child.pid, "start": started}
    assert started and not holder_is_dead(holder)
    child.kill()
    child.wait()
    assert holder_is_dead(holder)  # its pid is free
    assert holder_is_dead({**me, "start": "1"})  # this pid, but a process started since
    for unknown in (
        {**holder, "machine": "another-host|boot|pid:[1]"},  # elsewhere: the TTL decides
        {**holder, "machine": None},
        {**holder, "start": None},
        {**holder, "pid": "12"},
        None,
        {},
    ):
        assert not holder_is_dead(unknown), unknown


# -- DuckDB: the lease before DuckDB's own lock ---------------------------------------------------
def test_a_second_run_on_a_duckdb_file_held_by_a_long_run_is_refused_at_once(fresh_sim, tmp_path):
    """The lease is taken before the database is opened: the second run names the holder at
    once (before: ~106 s of waiting on DuckDB's file lock, then its raw error)."""
    db = str(tmp_path / "held.duckdb")
    create_demo_table(db, days=1, per_day=20)
    argv, env = duckdb_host(tmp_path, "long", fresh_sim, db)
    env["BATCH_LLM_JOURNAL_DIR"] = os.environ["BATCH_LLM_JOURNAL_DIR"]  # this host's
    fresh_sim.configure(latency_ms=5000, jitter=0.0)  # the long run holds on until told
    log_path = tmp_path / "long.log"
    with open(log_path, "w") as out:
        long_run = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for("the long run's first request", lambda: sent(fresh_sim) >= 1, long_run)
        started = time.monotonic()
        with InThread(fresh_sim, db, None, latency_ms=5000) as second:
            second.thread.join(timeout=STEP_TIMEOUT_S)
            took = time.monotonic() - started
            assert long_run.poll() is None, log_path.read_text()[-3000:]  # still holding on
            result = second.finish()
    finally:
        fresh_sim.configure(latency_ms=5.0)
        long_run.wait(timeout=STEP_TIMEOUT_S)
    assert not result.success
    assert "is already being processed by run " in failure(result)
    assert took < 20, took  # the run's own start, not a wait on DuckDB's lock
    assert long_run.returncode == 0, log_path.read_text()[-3000:]
