"""Batch mode when a partition's batches outlive a run: a run that does not wait and the sensor
that requests the partition once its batches complete, a run SIGKILLed while polling, an orphan
batch (killed before its id was recorded) adopted even behind thousands of newer ones, expired,
cancelled and error-file lines resubmitted alone and at most max_resubmits times, and the batch
state recorded on BigQuery and resumed from there."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.request

import dagster as dg
import duckdb
import pytest

from batch_llm_assets import LLMResource, SourceTable, build_llm_batch_asset
from batch_llm_assets.assets.batch_mode import BatchSettings

from .conftest import SIM_KEY, materialize_argv
from .conftest import duckdb_query as query
from .test_batch_mode import (  # noqa: F401  (fixtures)
    DAYS,
    PER_DAY,
    PROMPT,
    STATE,
    asset,
    batch_config,
    bsim,
    db,
    kill_while_polling_then_rerun,
    materialize,
    metadata,
    resources,
    statuses,
)
from .test_bigquery import bq, bq_endpoint, dataset  # noqa: F401  (fixtures)

_DEFS = """
import dagster as dg
from batch_llm_assets import DuckDBWarehouse, LLMResource, Prompt, SourceTable, build_llm_batch_asset
from batch_llm_assets.assets.batch_mode import BatchSettings

sentiment = build_llm_batch_asset(
    name="sentiment",
    source=SourceTable(table="news_headlines", partition_column="published_at", columns=["headline"]),
    prompt=Prompt(template={template!r}),
    output="news_sentiment",
    params={{"max_tokens": 5}},
    partitions_def=dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04"),
    mode="batch",
    batch=BatchSettings(poll_first_s=0.2, poll_max_s=0.5),
)
defs = dg.Definitions(assets=[sentiment], resources={{
    "llm": LLMResource(base_url="{url}", api_key="{key}", model="gpt-4o-mini"),
    "warehouse": DuckDBWarehouse(database="{db}"),
}})
"""


def _command(tmp_path, sim, db):  # noqa: F811
    defs = tmp_path / "defs.py"
    defs.write_text(_DEFS.format(template=PROMPT.template, url=sim.url, key=SIM_KEY, db=db))
    return materialize_argv(defs, tmp_path / "home", select="sentiment", partition="2026-11-01")


def test_sigkill_while_waiting_then_rerun_resumes_without_resubmitting(bsim, db, tmp_path):  # noqa: F811
    cmd, env = _command(tmp_path, bsim, db)
    kill_while_polling_then_rerun(bsim, cmd, env)
    stats = bsim.stats()
    assert (stats["files_uploaded"], stats["batches_created"]) == (1, 1)
    assert stats["batch_lines_submitted"] == PER_DAY == stats["batch_lines_processed"]
    assert query(
        db, "SELECT count(*), count(DISTINCT id), min(status), max(status) FROM news_sentiment"
    ) == [(PER_DAY, PER_DAY, "ok", "ok")]
    assert query(db, f"SELECT state FROM {STATE}") == [("collected",)]


def test_orphan_batch_of_a_run_killed_before_recording_it_is_adopted(bsim, db):  # noqa: F811
    assert materialize(asset(wait=False), bsim, db).success
    # The state a kill leaves between "provider accepted the batch" and "we recorded its id".
    con = __import__("duckdb").connect(db)
    con.execute(f"UPDATE {STATE} SET state = 'uploaded', batch_id = NULL")
    con.close()
    result = materialize(asset(), bsim, db)
    assert result.success
    stats = bsim.stats()
    assert (stats["batches_created"], stats["batch_lines_submitted"]) == (1, PER_DAY)
    assert statuses(db) == {"ok": PER_DAY}


def _other_teams_batches(sim, n):
    """`n` batches created on the key after ours (a long backfill, other teams' jobs)."""
    line = {
        "custom_id": "other",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
    }
    boundary = "b0undary"
    form = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="o.jsonl"\r\n'
        f"Content-Type: application/jsonl\r\n\r\n{json.dumps(line)}\n\r\n--{boundary}--\r\n"
    )
    auth = {"Authorization": f"Bearer {SIM_KEY}"}
    upload = urllib.request.Request(
        f"{sim.url}/files",
        data=form.encode(),
        headers=auth | {"Content-Type": f"multipart/form-data; boundary={boundary}"},
    )
    with urllib.request.urlopen(upload, timeout=10) as resp:
        file_id = json.loads(resp.read())["id"]
    body = json.dumps({"input_file_id": file_id, "endpoint": "/v1/chat/completions"}).encode()

    def create(_):
        req = urllib.request.Request(
            f"{sim.url}/batches", data=body, headers=auth | {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())["id"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(create, range(n)))


def test_an_orphan_batch_is_found_behind_thousands_of_newer_batches(bsim, db):  # noqa: F811
    """A kill between creating the batch and recording it, then 2,100 newer batches on the key:
    the search goes back to the input file's upload, however many batches that is."""
    assert materialize(asset(wait=False), bsim, db).success
    con = duckdb.connect(db)
    con.execute(f"UPDATE {STATE} SET state = 'uploaded', batch_id = NULL")
    con.close()
    assert len(_other_teams_batches(bsim, 2_100)) == 2_100
    before = bsim.stats()
    assert materialize(asset(), bsim, db).success
    after = bsim.stats()
    assert after["batches_created"] == before["batches_created"]  # adopted, not resubmitted
    assert after["batch_lines_submitted"] == before["batch_lines_submitted"]
    assert statuses(db) == {"ok": PER_DAY}
    assert query(db, f"SELECT state FROM {STATE}") == [("collected",)]


def _within(seconds, fn):
    """fn() in a thread, which must end within `seconds` (a run that never ends fails here)."""
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s"
    return out[0]


def test_batches_that_keep_expiring_are_resubmitted_at_most_max_resubmits_times(bsim, db):  # noqa: F811
    assert BatchSettings().max_resubmits == 3
    batch_config(bsim, expire_fraction=0.0)  # every batch expires before reaching any line
    result = _within(60, lambda: materialize(asset(max_resubmits=2), bsim, db))
    assert not result.success  # every row failed: over max_failed_fraction, and the run ended
    stats = bsim.stats()
    assert (stats["batches_created"], stats.get("batch_lines_processed", 0)) == (3, 0)
    assert statuses(db) == {"failed": PER_DAY}
    ((error_class, error),) = query(db, "SELECT DISTINCT error_class, error FROM news_sentiment")
    assert error_class == "batch_expired"
    assert "3 batches in a row ended expired" in error and "(max_resubmits=2)" in error
    # Failed rows are not done: with the provider healthy again, a rerun sends them.
    batch_config(bsim, expire_fraction=None)
    assert materialize(asset(), bsim, db).success
    assert statuses(db) == {"ok": PER_DAY}


def test_expired_batch_keeps_its_results_and_resubmits_only_the_rest(bsim, db):  # noqa: F811
    batch_config(bsim, expire_fraction=0.5)
    assert materialize(asset(wait=False), bsim, db).success
    time.sleep(0.6)
    expired = materialize(asset(wait=False), bsim, db)  # collects half, resubmits the rest
    assert expired.success
    assert statuses(db) == {"ok": PER_DAY // 2}
    assert metadata(expired)["batches_submitted"] == 1
    batch_config(bsim, expire_fraction=None)
    final = materialize(asset(), bsim, db)
    assert final.success
    md = metadata(final)
    assert (md["run/rows_ok"], md["run/rows_skipped"]) == (PER_DAY // 2, PER_DAY // 2)
    stats = bsim.stats()
    assert stats["batches_created"] == 2
    assert stats["batch_lines_submitted"] == PER_DAY + PER_DAY // 2
    assert stats["batch_lines_processed"] == PER_DAY  # no row answered (and paid) twice
    assert statuses(db) == {"ok": PER_DAY}


def test_error_file_lines_become_failed_rows_and_a_rerun_resends_only_them(bsim, db):  # noqa: F811
    batch_config(bsim, line_fail=0.3)
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize(
        [asset()],
        resources=resources(bsim, db),
        partition_key="2026-11-01",
        raise_on_error=False,
        instance=instance,
    )
    failed = bsim.stats()["batch_lines_failed"]
    assert 0 < failed < PER_DAY
    assert not result.success  # over max_failed_fraction, after every row was written
    # The failed partition is checked too, its evaluation naming the partition (issue 28).
    (record,) = instance.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(dg.AssetKey("sentiment"), "failed_fraction"), limit=5
    )
    assert record.partition == "2026-11-01" and record.status.value == "FAILED"
    assert statuses(db) == {"ok": PER_DAY - failed, "failed": failed}
    reasons = query(
        db, "SELECT DISTINCT error_class, error FROM news_sentiment WHERE status = 'failed'"
    )
    assert reasons == [
        ("server_error", "HTTP 500: The server had an error while processing your request.")
    ]
    batch_config(bsim, line_fail=0.0)
    assert materialize(asset(), bsim, db).success
    assert bsim.stats()["batch_lines_submitted"] == PER_DAY + failed
    assert statuses(db) == {"ok": PER_DAY}


def test_sensor_requests_the_partition_once_its_batches_complete(bsim, db):  # noqa: F811
    from batch_llm_assets.sensors import build_batch_completion_sensor

    a = asset(wait=False)
    sensor = build_batch_completion_sensor(asset=a)
    batch_config(bsim, completion_s=60.0)
    submitted = materialize(a, bsim, db)
    assert submitted.success and metadata(submitted)["batches_open"] == 1
    assert statuses(db) == {}

    def tick():
        with (
            dg.instance_for_test() as instance,
            dg.build_sensor_context(instance=instance, resources=resources(bsim, db)) as ctx,
        ):
            return sensor(ctx)

    assert isinstance(tick(), dg.SkipReason)  # still in progress
    batch_config(bsim, completion_s=0.1)
    result = tick()
    [request] = result.run_requests
    assert request.partition_key == "2026-11-01"
    collected = materialize(a, bsim, db)  # what the requested run does: collect only
    assert collected.success and metadata(collected)["batches_submitted"] == 0
    assert statuses(db) == {"ok": PER_DAY}
    assert bsim.stats()["batches_created"] == 1
    assert isinstance(tick(), dg.SkipReason)  # nothing open any more


@pytest.mark.bigquery
def test_batch_mode_on_bigquery_records_state_and_resumes(bsim, bq_endpoint, bq, dataset):  # noqa: F811
    from batch_llm_assets.resources.bigquery_warehouse import BigQueryWarehouse

    from .test_bigquery import PER_DAY as BQ_PER_DAY
    from .test_bigquery import PROJECT
    from .test_bigquery import query as bq_query

    a = build_llm_batch_asset(
        name="sentiment",
        source=SourceTable(
            table=f"{dataset}.news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=PROMPT,
        output=f"{dataset}.news_sentiment",
        params={"max_tokens": 5},
        partitions_def=DAYS,
        mode="batch",
        batch=BatchSettings(poll_first_s=0.2, poll_max_s=0.5, wait=False),
    )
    res = {
        "llm": LLMResource(base_url=bsim.url, api_key=SIM_KEY, model="gpt-4o-mini"),
        "warehouse": BigQueryWarehouse(project=PROJECT, api_endpoint=bq_endpoint),
    }
    run = lambda: dg.materialize([a], resources=res, partition_key="2026-11-01")  # noqa: E731
    assert metadata(run())["batches_open"] == 1
    state = f"`{dataset}`.`news_sentiment__bla_batches`"
    assert bq_query(bq, f"SELECT state, n_requests FROM {state}") == [("submitted", BQ_PER_DAY)]
    time.sleep(0.6)
    assert metadata(run())["run/rows_ok"] == BQ_PER_DAY  # collects only
    assert bq_query(bq, f"SELECT state, provider_status FROM {state}") == [
        ("collected", "completed")
    ]
    assert bq_query(
        bq, f"SELECT count(*) FROM `{dataset}`.`news_sentiment` WHERE status = 'ok'"
    ) == [(BQ_PER_DAY,)]
    assert bsim.stats()["batches_created"] == 1


def test_cancelled_batch_keeps_its_results_and_resubmits_only_the_rest(bsim, db):  # noqa: F811
    batch_config(bsim, completion_s=4.0)
    submitted = materialize(asset(wait=False), bsim, db)
    [batch_id] = metadata(submitted)["batch_ids"]
    time.sleep(2.0)  # about half way: the simulator cancels with the lines it got to
    req = urllib.request.Request(
        f"{bsim.url}/batches/{batch_id}/cancel",
        data=b"",
        method="POST",
        headers={"Authorization": f"Bearer {SIM_KEY}"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.loads(resp.read())["status"] == "cancelled"
    done_by_cancelled = bsim.stats()["batch_lines_processed"]
    assert 0 < done_by_cancelled < PER_DAY
    batch_config(bsim, completion_s=0.3)
    assert materialize(asset(), bsim, db).success
    stats = bsim.stats()
    assert stats["batch_lines_submitted"] == 2 * PER_DAY - done_by_cancelled
    assert stats["batch_lines_processed"] == PER_DAY
    assert statuses(db) == {"ok": PER_DAY}
