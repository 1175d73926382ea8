"""Stored answers reused (issue 30): across partitions and runs of an asset, after a SIGKILL,
on an indexed table; typed columns included. The simulator counts what was sent."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import duckdb

from batch_llm_assets.demo_data import create_demo_table

from .conftest import duckdb_query as query
from .conftest import materialize_command
from .test_sharing import (
    DAY1,
    DAY2,
    asset,
    make_table,
    materialize,
    metadata,
    received,
    rows_of,
    with_duplicates,
)

STEP_TIMEOUT_S = 120  # one subprocess step, on a busy machine


# -- across partitions and runs ----------------------------------------------------------------


def overlapping_days(db: str) -> int:
    """Day 1: 200 rows, 150 distinct. Day 2: 200 rows, half of its 150 distinct requests are
    day 1's. Returns day 2's new distinct requests."""
    day1 = with_duplicates(200, 150, seed=3, prefix="a")
    old = sorted(set(day1))[:75]
    new = [f"b{i} shares move on results" for i in range(75)]
    rng = random.Random(4)
    day2 = old + new + [rng.choice(old + new) for _ in range(50)]
    rng.shuffle(day2)
    make_table(db, {DAY1: day1, DAY2: day2})
    return len(new)


def test_a_second_partition_reuses_the_answers_stored_by_the_first(fresh_sim, tmp_path):
    db = str(tmp_path / "w.duckdb")
    new = overlapping_days(db)
    assert materialize(asset(), fresh_sim, db).success
    assert received(fresh_sim) == 150
    result = materialize(asset(), fresh_sim, db, key=DAY2)
    assert result.success
    assert received(fresh_sim) == 150 + new  # only the new half was sent
    md = metadata(result)
    assert md["run/rows_sent"] == new
    assert md["run/answers_reused"] + md["run/requests_deduplicated"] == 200 - new
    assert md["run/answers_reused"] >= 75
    day2 = rows_of(db, DAY2)
    assert len(day2) == 200 and {r[2] for r in day2} == {"ok"}
    day1 = {r[7]: r for r in rows_of(db, DAY1) if r[6] is None}
    for _rid, headline, _status, response, cost, tokens, shared_from, h in day2:
        if h in day1:  # an answer of day 1: named as day/id, the same answer
            source = day1[h]
            assert shared_from == f"{DAY1}/{source[0]}"
            assert (response, headline, cost, tokens) == (source[3], source[1], 0, None)
    assert md["run/cost_saved_usd"] > 0


def test_temperature_above_zero_reuses_nothing_across_partitions_by_default(fresh_sim, tmp_path):
    db = str(tmp_path / "w.duckdb")
    new = overlapping_days(db)
    warm = asset(params={"max_tokens": 5, "temperature": 0.7})
    assert materialize(warm, fresh_sim, db).success
    assert received(fresh_sim) == 150  # within a partition, still once per request
    assert materialize(warm, fresh_sim, db, key=DAY2).success
    assert received(fresh_sim) == 150 + 150
    assert query(db, f"SELECT count(*) FROM news_sentiment WHERE shared_from LIKE '{DAY1}/%'") == [
        (0,)
    ]
    # Asked for, answers are reused at any temperature.
    db2 = str(tmp_path / "w2.duckdb")
    overlapping_days(db2)
    opted = asset(params={"max_tokens": 5, "temperature": 0.7}, reuse_answers=True)
    assert materialize(opted, fresh_sim, db2).success
    assert materialize(opted, fresh_sim, db2, key=DAY2).success
    assert received(fresh_sim) == 300 + 150 + new


def test_reuse_answers_false_sends_every_distinct_request_of_each_partition(fresh_sim, tmp_path):
    db = str(tmp_path / "w.duckdb")
    overlapping_days(db)
    off = asset(reuse_answers=False)
    assert materialize(off, fresh_sim, db).success
    assert materialize(off, fresh_sim, db, key=DAY2).success
    assert received(fresh_sim) == 300


# -- crash safety ----------------------------------------------------------------------------------


def test_a_sigkill_mid_run_loses_no_row_and_pays_no_identity_twice(fresh_sim, tmp_path):
    """The demo's headlines repeat (about 1,000 distinct ones): a run is killed once most
    requests are answered, and the rerun finishes it. Every row ends ok; what was paid twice
    is at most what was in flight at the kill."""
    db = str(tmp_path / "crash.duckdb")
    create_demo_table(db, days=1, per_day=2000)
    distinct = query(db, "SELECT count(DISTINCT headline) FROM news_headlines")[0][0]
    cmd, env = materialize_command(tmp_path, fresh_sim, db, chunk_rows=100, max_concurrency=4)
    fresh_sim.configure(latency_ms=10.0)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while proc.poll() is None and fresh_sim.stats().get("answered", 0) < distinct // 2:
        assert time.monotonic() < deadline, "no answers within the step's time limit"
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    final = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    assert final.returncode == 0, final.stderr[-2000:]
    assert query(db, "SELECT count(*), count(DISTINCT id) FROM news_sentiment") == [(2000, 2000)]
    assert query(db, "SELECT DISTINCT status FROM news_sentiment") == [("ok",)]
    stats = fresh_sim.stats()
    assert stats["distinct_prompts"] == distinct
    assert stats["resent_prompts"] <= 4  # at most the requests in flight at the kill
    # One paying row per identity in the table: the kill lost no shared row and no answer.
    assert query(
        db,
        "SELECT count(*) FROM (SELECT request_hash FROM news_sentiment WHERE shared_from IS NULL "
        "GROUP BY request_hash HAVING count(*) > 1)",
    ) == [(0,)]
    assert query(
        db,
        "SELECT count(DISTINCT request_hash), count(*) FILTER (shared_from IS NULL) "
        "FROM news_sentiment",
    ) == [(distinct, distinct)]


def test_the_lookup_is_indexed_on_new_and_existing_duckdb_tables(fresh_sim, tmp_path):
    """A new output table is created with its request_hash index; one of the layout before
    issue 30 (no shared_from, no index) gains both on its next run, and its answers are reused."""
    from batch_llm_assets.assets.schema import OUTPUT_COLUMNS
    from batch_llm_assets.warehouses.duckdb_types import TYPES

    def indexes(db):
        return query(db, "SELECT table_name, expressions FROM duckdb_indexes() ORDER BY 1")

    new_db, old_db = str(tmp_path / "new.duckdb"), str(tmp_path / "old.duckdb")
    texts = with_duplicates(100, 60, seed=6)
    for db in (new_db, old_db):
        make_table(db, {DAY1: texts, DAY2: texts})
    assert materialize(asset(), fresh_sim, new_db).success
    assert indexes(new_db) == [("news_sentiment", "[request_hash]")]
    con = duckdb.connect(old_db)
    cols = ", ".join(f"{c} {TYPES[t]}" for c, t in OUTPUT_COLUMNS if c != "shared_from")
    con.execute(f"CREATE TABLE news_sentiment (id BIGINT, {cols}, PRIMARY KEY (partition_key, id))")
    con.close()
    assert indexes(old_db) == []
    assert materialize(asset(), fresh_sim, old_db).success
    assert indexes(old_db) == [("news_sentiment", "[request_hash]")]
    before = received(fresh_sim)
    assert materialize(asset(), fresh_sim, old_db, key=DAY2).success
    assert received(fresh_sim) == before  # day 2 repeats day 1: everything reused


def test_typed_columns_are_shared_within_a_run_and_reused_from_the_table(fresh_sim, tmp_path):
    fresh_sim.configure(invalid_json=0.0, truncated_json=0.0, refuse=0.0, reject_json_schema=False)
    db = str(tmp_path / "w.duckdb")
    new = overlapping_days(db)
    schema = {
        "label": {"type": "enum", "values": ["positive", "negative", "neutral"]},
        "tickers": {"type": "list", "items": "string"},
        "details": {"type": "object"},
    }
    typed = asset(output_schema=schema, params={"max_tokens": 120, "temperature": 0})
    assert materialize(typed, fresh_sim, db).success
    assert materialize(typed, fresh_sim, db, key=DAY2).success
    assert received(fresh_sim) == 150 + new
    rows = query(
        db,
        "SELECT partition_key, id, request_hash, shared_from, status, response, label, tickers, "
        "details::VARCHAR FROM news_sentiment ORDER BY partition_key, id",
    )
    assert len(rows) == 400 and {r[4] for r in rows} == {"ok"}
    payers = {r[2]: r for r in rows if r[3] is None}
    assert len(payers) == 150 + new
    for r in rows:
        assert r[5:] == payers[r[2]][5:]  # response and every typed column, as the payer's
