"""The batch asset: materialise partitions against the simulator and DuckDB, rerun, resume."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import dagster as dg
import duckdb
import pytest

from batch_llm_assets import (
    DuckDBWarehouse,
    LLMResource,
    Prompt,
    SourceTable,
    build_llm_batch_asset,
)
from batch_llm_assets.engine.errors import BatchLLMError

from .conftest import SIM_KEY, create_distinct_table, materialize_command
from .conftest import duckdb_query as query

DAYS = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04")
PROMPT = Prompt(
    system="Reply with one word.",
    template="Headline: {{ headline }}\nAnswer with one of: positive, negative, neutral",
)


def asset(**kw):
    settings = dict(
        name="sentiment",
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=PROMPT,
        output="news_sentiment",
        params={"max_tokens": 5},
        partitions_def=DAYS,
        chunk_rows=40,
    )
    return build_llm_batch_asset(**(settings | kw))


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "w.duckdb")
    create_distinct_table(path, days=3, per_day=60)
    return path


def resources(sim, db, **llm):
    return {
        "llm": LLMResource(
            base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini", **({"max_attempts": 3} | llm)
        ),
        "warehouse": DuckDBWarehouse(database=db),
    }


def materialize(a, sim, db, key="2026-11-01", **llm):
    return dg.materialize(
        [a], resources=resources(sim, db, **llm), partition_key=key, raise_on_error=False
    )


def metadata(result, name="sentiment"):
    mats = result.asset_materializations_for_node(name)
    return {k: v.value for k, v in mats[-1].metadata.items()}


def test_partition_rows_statuses_and_metadata(fresh_sim, db):
    a = asset()
    # The simulator is on localhost (not priced by default): price it as gpt-4o-mini's list price.
    result = materialize(a, fresh_sim, db, price_input_per_1m=0.15, price_output_per_1m=0.60)
    assert result.success
    md = metadata(result)
    assert md["partition/rows_input"] == md["partition/rows_ok"] == 60
    assert md["run/rows_ok"] == md["dagster/row_count"] == 60
    assert md["partition/rows_failed"] == 0 and md["run/rows_skipped"] == 0
    assert md["run/prompt_tokens"] > 0 and md["run/completion_tokens"] >= 60
    assert md["partition/prompt_tokens"] == md["run/prompt_tokens"]
    # gpt-4o-mini: $0.15 / $0.60 per 1M tokens
    expected = (md["run/prompt_tokens"] * 0.15 + md["run/completion_tokens"] * 0.60) / 1e6
    assert md["run/cost_usd"] == pytest.approx(expected, rel=1e-3)
    assert md["partition/cost_usd"] == pytest.approx(expected, rel=1e-3)
    assert 0 < md["run/latency_p50_ms"] <= md["run/latency_p95_ms"] <= md["run/latency_max_ms"]
    for key in (
        "run/wall_s",
        "run/rows_per_s",
        "run/tokens_per_min",
        "run/requests_waited_fraction",
        "run/limiter_wait_mean_s",
        "run/retries",
        "run/http_429",
    ):
        assert isinstance(md[key], int | float)
    assert "60" in md["summary"]
    rows = query(
        db, "SELECT status, response, partition_key, model, request_hash FROM news_sentiment"
    )
    assert len(rows) == 60
    assert {r[0] for r in rows} == {"ok"}
    assert {r[1] for r in rows} <= {"positive", "negative", "neutral"}
    assert {r[2] for r in rows} == {"2026-11-01"} and {r[3] for r in rows} == {"gpt-4o-mini"}
    # Only the partition's slice was read: other days untouched.
    assert fresh_sim.stats()["answered"] == 60
    schema = a.specs_by_key[dg.AssetKey("sentiment")].metadata["dagster/column_schema"]
    assert "request_hash" in {c.name for c in schema.columns}


def test_rerun_is_idempotent_and_skips_done_rows(fresh_sim, db, monkeypatch):
    from batch_llm_assets.warehouses.duckdb_session import DuckDBSession

    lookups = []  # skip-done lookups (a query each; a BigQuery job each), on the real session
    real = DuckDBSession.done_hashes
    monkeypatch.setattr(
        DuckDBSession, "done_hashes", lambda s, *a, **k: lookups.append(1) or real(s, *a, **k)
    )
    a = asset()
    assert materialize(a, fresh_sim, db).success
    assert lookups == []  # a partition without output rows has nothing to skip
    second = materialize(a, fresh_sim, db)
    assert lookups
    assert second.success
    md = metadata(second)
    assert md["run/rows_skipped"] == 60 and md["run/rows_ok"] == 0
    assert md["partition/rows_ok"] == md["dagster/row_count"] == 60
    assert fresh_sim.stats()["answered"] == 60  # nothing was sent again
    assert query(db, "SELECT count(*), count(DISTINCT id) FROM news_sentiment") == [(60, 60)]
    # A changed prompt is different work: every row is sent again, still one row per id.
    changed = asset(prompt=Prompt(template="Sentiment of: {{ headline }}"), params={})
    md = metadata(materialize(changed, fresh_sim, db))
    assert md["run/rows_ok"] == 60 and md["run/rows_skipped"] == 0
    assert query(db, "SELECT count(*), count(DISTINCT id) FROM news_sentiment") == [(60, 60)]


def test_failed_rows_fail_the_run_after_writing_and_are_retried(fresh_sim, db):
    fresh_sim.configure(fail_503=1.0)
    first = materialize(asset(), fresh_sim, db, max_attempts=1)
    assert not first.success
    failure = first.get_step_failure_events()[0].step_failure_data.error
    assert "server_error (60)" in failure.message
    assert "60 of the partition's 60 rows have failed" in failure.message
    assert query(db, "SELECT status, error_class, count(*) FROM news_sentiment GROUP BY ALL") == [
        ("failed", "server_error", 60)
    ]
    fresh_sim.configure(fail_503=0.0)
    md = metadata(materialize(asset(), fresh_sim, db))
    assert md["run/rows_ok"] == 60 and md["run/rows_skipped"] == 0
    assert query(db, "SELECT status, count(*) FROM news_sentiment GROUP BY ALL") == [("ok", 60)]


def test_failures_under_the_threshold_still_succeed(fresh_sim, db):
    con = duckdb.connect(db)
    con.execute("UPDATE news_headlines SET headline = NULL WHERE id = 1")
    con.execute("UPDATE news_headlines SET headline = '   ' WHERE id = 2")
    con.close()
    result = materialize(asset(max_failed_fraction=0.05), fresh_sim, db)
    assert result.success
    md = metadata(result)
    # A NULL printed as it is fails its row; a blank headline still renders a non-blank prompt
    # ("Headline: ...\nAnswer with one of: ..."), so it is sent: only a blank message is empty.
    assert md["partition/rows_ok"] == 59 and md["partition/rows_failed"] == 1
    rows = dict(query(db, "SELECT id, error FROM news_sentiment WHERE status = 'failed'"))
    assert list(rows) == [1] and "NULL" in rows[1] and "not sent" in rows[1]
    assert fresh_sim.stats()["received"] == 59  # the bad row never reached the provider
    assert not materialize(asset(max_failed_fraction=0.0), fresh_sim, db).success


def test_templates_may_handle_nulls_themselves(fresh_sim, db):
    con = duckdb.connect(db)
    con.execute("UPDATE news_headlines SET headline = NULL WHERE id IN (1, 2)")
    con.close()
    handled = asset(
        prompt=Prompt(
            template="{% if headline %}Headline: {{ headline }}{% endif %}"
            "{{ headline | default('(no headline)') }} Answer with one of: up, down"
        )
    )
    md = metadata(materialize(handled, fresh_sim, db))
    assert md["partition/rows_ok"] == 60 and md["partition/rows_failed"] == 0
    # Blank only when the rendered user message is blank: then the row is empty_prompt, unsent.
    received = fresh_sim.stats()["received"]
    blank = asset(prompt=Prompt(template="{% if headline %}{{ headline }}{% endif %}"), params={})
    md = metadata(materialize(blank, fresh_sim, db))
    assert md["partition/rows_ok"] == 58 and md["partition/rows_failed"] == 2
    rows = query(db, "SELECT id, error_class FROM news_sentiment WHERE status = 'failed'")
    assert sorted(rows) == [(1, "empty_prompt"), (2, "empty_prompt")]
    assert fresh_sim.stats()["received"] == received + 58


def test_prompt_over_the_context_window_fails_its_row_only(fresh_sim, db):
    con = duckdb.connect(db)
    con.execute("UPDATE news_headlines SET headline = repeat('word ', 2500) WHERE id = 3")
    # Over 8 characters per token of the window: refused at rendering, never tokenized.
    con.execute("UPDATE news_headlines SET headline = repeat('word ', 5000) WHERE id = 4")
    con.close()
    md = metadata(materialize(asset(), fresh_sim, db, context_window=2000))
    assert md["partition/rows_failed"] == 2 and md["partition/rows_ok"] == 58
    rows = query(db, "SELECT id, error_class FROM news_sentiment WHERE id IN (3, 4) ORDER BY id")
    assert rows == [(3, "context_length"), (4, "prompt_too_large")]
    assert fresh_sim.stats()["received"] == 58


def test_a_local_server_is_not_priced_unless_told(fresh_sim, db):
    # Why (issue 28): the demo's cost read 0, a number, for a local server that nobody bills;
    # unpriced, it shows "not priced" and no cost figure.
    md = metadata(materialize(asset(model="sim-1"), fresh_sim, db))
    assert "run/cost_usd" not in md and md["partition/rows_ok"] == 60
    assert md["pricing"] == "pricing: not priced" and "not priced" in md["summary"]
    assert query(db, "SELECT count(*) FROM news_sentiment WHERE cost_usd IS NULL") == [(60,)]


def test_a_stand_in_is_priced_as_the_model_it_names(fresh_sim, db):
    md = metadata(materialize(asset(), fresh_sim, db, price_as_model="gpt-4o-mini"))
    expected = (md["run/prompt_tokens"] * 0.15 + md["run/completion_tokens"] * 0.60) / 1e6
    assert md["run/cost_usd"] == pytest.approx(expected, rel=1e-3) and expected > 0
    assert md["pricing"] == "pricing: simulated at gpt-4o-mini list prices"
    assert md["cost_usd_to_date"] == pytest.approx(md["partition/cost_usd"])


def test_static_partitions(fresh_sim, tmp_path):
    path = str(tmp_path / "s.duckdb")
    con = duckdb.connect(path)
    con.execute("CREATE TABLE tickets (ticket_id INT, region VARCHAR, body VARCHAR)")
    con.executemany(
        "INSERT INTO tickets VALUES (?, ?, ?)",
        [(i, "eu" if i % 2 else "us", f"ticket {i}") for i in range(20)],
    )
    con.close()
    a = build_llm_batch_asset(
        name="triage",
        source=SourceTable(table="tickets", id_column="ticket_id", partition_column="region"),
        prompt="Classify: {{ body }}",
        output="triage_out",
        partitions_def=dg.StaticPartitionsDefinition(["eu", "us"]),
    )
    result = dg.materialize([a], resources=resources(fresh_sim, path), partition_key="eu")
    assert metadata(result, "triage")["partition/rows_ok"] == 10
    assert query(path, "SELECT min(id), max(id), count(*) FROM triage_out") == [(1, 19, 10)]


@pytest.mark.parametrize(
    "template,column", [("{{ headline }} {{ body }}", "body"), ("{{ nope }}", "nope")]
)
def test_unknown_column_is_an_error_at_definition_time(template, column):
    with pytest.raises(BatchLLMError, match=f"unknown column.*{column}"):
        asset(prompt=Prompt(template=template))


def test_malformed_template_is_an_error_at_definition_time():
    with pytest.raises(BatchLLMError, match="Malformed prompt template"):
        asset(prompt=Prompt(template="{{ headline "))


def test_missing_column_in_the_table_fails_before_any_request(fresh_sim, db):
    a = asset(
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline", "body"]
        ),
        prompt=Prompt(template="{{ headline }} {{ body }}"),
    )
    result = materialize(a, fresh_sim, db)
    assert not result.success
    assert "body" in result.get_step_failure_events()[0].step_failure_data.error.message
    assert fresh_sim.stats().get("received", 0) == 0


@pytest.mark.parametrize("bad", ['news"; DROP TABLE x; --', "news`s", "a.b.c.d", "t -- c", "x;y"])
def test_unsafe_table_names_are_refused_and_nothing_is_written(bad, db):
    with pytest.raises(BatchLLMError, match="Invalid table"):
        asset(source=SourceTable(table=bad, partition_column="published_at", columns=["headline"]))
    with pytest.raises(BatchLLMError, match="Invalid table"):
        asset(output=bad)
    assert query(db, "SELECT count(*) FROM information_schema.tables") == [(1,)]


def test_sandbox_keeps_python_objects_out_of_reach(fresh_sim, db):
    a = asset(prompt=Prompt(template="{{ headline.__class__.__mro__ }}"))
    assert not materialize(a, fresh_sim, db).success
    rows = query(db, "SELECT DISTINCT error_class, error FROM news_sentiment")
    assert len(rows) == 1 and rows[0][0] == "prompt_render" and "not sent" in rows[0][1]
    assert fresh_sim.stats().get("received", 0) == 0


def test_resume_after_sigkill_loses_nothing_and_resends_little(fresh_sim, tmp_path):
    db = str(tmp_path / "k.duckdb")
    create_distinct_table(db, days=1, per_day=400)
    cmd, env = materialize_command(tmp_path, fresh_sim, db, chunk_rows=25, max_concurrency=8)
    fresh_sim.configure(latency_ms=60.0)  # ~130 rows/s with 8 in flight: a run of ~3 s
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 120
    while fresh_sim.stats().get("answered", 0) < 150 and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the run and anything it started, mid-partition
    proc.wait()
    time.sleep(0.5)  # requests that were in flight finish at the simulator (and were paid)
    answered_at_kill = fresh_sim.stats()["answered"]
    assert 150 <= answered_at_kill < 400
    written = query(db, "SELECT count(*) FROM news_sentiment")[0][0]
    assert written <= answered_at_kill

    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    ids = query(db, "SELECT count(*), count(DISTINCT id), min(id), max(id) FROM news_sentiment")
    assert ids == [(400, 400, 1, 400)]  # no duplicate, no lost id
    assert query(db, "SELECT DISTINCT status FROM news_sentiment") == [("ok",)]
    # Only rows answered but not yet written when the run died were paid for twice.
    resent = fresh_sim.stats()["answered"] - 400
    assert resent <= answered_at_kill - written
    # Answers that arrived before the kill were journaled and recovered: only answers still in
    # the socket when the process died (at most the 8 in flight) can have been paid twice.
    assert resent <= 8
