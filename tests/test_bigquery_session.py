"""BigQuerySession's own reads and writes on the bqemulator, without an LLM: paged slices with
parameters, UTC-exact time windows under any process time zone, MERGE writes in bounded chunks,
four partition runs into one output table, retried concurrent-update refusals, old output tables
re-clustered, output datasets created and listed, and the writer's interval setting."""

from __future__ import annotations

import threading
import time
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from google.api_core import exceptions as gexc
from google.cloud import bigquery

from batch_llm_assets.assets.schema import OUTPUT_COLUMNS, output_table
from batch_llm_assets.engine.errors import BatchLLMError
from batch_llm_assets.resources.bigquery_warehouse import BigQueryWarehouse
from batch_llm_assets.warehouses import bigquery_dml as bqw_dml
from batch_llm_assets.warehouses import bigquery_session as bqw
from batch_llm_assets.warehouses.base import OutputTable, SliceFilter, SourceRef
from batch_llm_assets.warehouses.bigquery_dml import TYPES as BQ_TYPES
from batch_llm_assets.warehouses.duckdb_session import DuckDBSession

from .test_bigquery import PER_DAY, PROJECT, bq, bq_endpoint, dataset, day_ids, query, warehouse  # noqa: F401  (fixtures)

pytestmark = pytest.mark.bigquery


def test_session_reads_pages_and_filters_by_parameters(bq_endpoint, bq, dataset):  # noqa: F811
    src = SourceRef(f"{dataset}.news_headlines", "id", ("headline",), "published_at")
    day = SliceFilter(
        column="published_at",
        start=datetime(2026, 11, 1, tzinfo=UTC),
        end=datetime(2026, 11, 2, tzinfo=UTC),
    )
    with warehouse(bq_endpoint).session() as s:
        s.check_source(src)
        assert s.slice_stats(src, day) == (PER_DAY, [], 0)
        chunks = list(s.read_slice(src, day, 7))
        assert [len(c) for c in chunks] == [7, 7, 6]
        ids = [r["id"] for c in chunks for r in c]
        assert ids == sorted(day_ids("2026-11-01"))
        assert set(chunks[0][0]) == {"id", "headline"}
        # Equality on an INT64 column: the partition key string is sent as an INT64 parameter.
        query(
            bq,
            f"CREATE TABLE `{dataset}`.`b` AS SELECT id, MOD(id, 3) AS bucket, headline "
            f"FROM `{dataset}`.`news_headlines`",
        )
        b = SourceRef(f"{dataset}.b", "id", ("headline",), "bucket")
        assert s.slice_stats(b, SliceFilter(column="bucket", value="1"))[0] == 3 * PER_DAY // 3
        # A value that would be SQL if it were pasted in is just a value that matches nothing.
        sneaky = SliceFilter(column="headline", value="x' OR TRUE --")
        assert s.slice_stats(SourceRef(src.table, "id", ("headline",), "headline"), sneaky)[0] == 0
        with pytest.raises(BatchLLMError, match="not an integer"):
            s.slice_stats(b, SliceFilter(column="bucket", value="1 OR TRUE"))


def test_writes_merge_in_bounded_chunks_and_upsert(bq_endpoint, bq, dataset, monkeypatch):  # noqa: F811
    monkeypatch.setattr(bqw, "MERGE_MAX_ROWS", 3)
    src = SourceRef(f"{dataset}.news_headlines", "id", ("headline",), "published_at")
    out = output_table(f"{dataset}.out_chunks")
    now = datetime.now(UTC)

    def row(i, status, response=None):
        return {
            "id": i,
            "partition_key": "p",
            "status": status,
            "response": response,
            "request_hash": f"h{i}",
            "completed_at": now,
            "prompt_tokens": i,
            "cost_usd": None,
        }

    with warehouse(bq_endpoint).session() as s:
        s.ensure_output(out, src)
        s.ensure_output(out, src)  # idempotent
        s.write_results(out, [row(i, "failed") for i in range(10)])
        assert s.count_output(out.name, "p") == 10
        # Replaces rows in place; the same id twice in one batch: the last one wins.
        s.write_results(out, [row(i, "ok", "fine") for i in range(5, 12)] + [row(11, "ok", "last")])
        assert s.done_hashes(out, "p", list(range(20))) == {i: f"h{i}" for i in range(5, 12)}
    rows = query(
        bq,
        f"SELECT COUNT(*), COUNT(DISTINCT id), COUNTIF(status = 'ok') FROM `{dataset}`.`out_chunks`",
    )
    assert rows == [(12, 12, 7)]
    assert query(bq, f"SELECT response FROM `{dataset}`.`out_chunks` WHERE id = 11") == [("last",)]
    # A byte bound splits too: two rows of ~1.5 MiB each never share a statement.
    monkeypatch.setattr(bqw, "MERGE_MAX_ROWS", 500)
    monkeypatch.setattr(bqw, "MERGE_MAX_BYTES", 2 * 1024 * 1024)
    sent = []
    with warehouse(bq_endpoint).session() as s:
        original = s._write_chunk
        monkeypatch.setattr(
            s, "_write_chunk", lambda t, pk, c: (sent.append(len(c)), original(t, pk, c))
        )
        s.write_results(
            out,
            [row(100, "ok", "x" * 1_500_000), row(101, "ok", "y" * 1_500_000), row(102, "ok", "z")],
        )
    assert sent == [1, 2]
    assert query(bq, f"SELECT LENGTH(response) FROM `{dataset}`.`out_chunks` WHERE id = 100") == [
        (1_500_000,)
    ]


def test_output_dataset_is_created_and_tables_are_listed(bq_endpoint, bq, dataset):  # noqa: F811
    src = SourceRef(f"{dataset}.news_headlines", "id", ("headline",), "published_at")
    out_dataset = f"{dataset}_out"
    with warehouse(bq_endpoint).session() as s:
        s.ensure_output(output_table(f"{PROJECT}.{out_dataset}.results"), src)
        s.ensure_output(output_table(f"{out_dataset}.b_results"), src)
        assert s.list_tables(out_dataset, 10) == ["b_results", "results"]
        assert s.list_tables(f"{PROJECT}.{out_dataset}", 1) == ["b_results"]
        with pytest.raises(BatchLLMError, match=f"dataset {PROJECT}.nope_{dataset} does not exist"):
            s.list_tables(f"nope_{dataset}", 10)
        with pytest.raises(BatchLLMError, match="Invalid"):
            s.list_tables("x`; DROP SCHEMA y", 10)
    query(bq, f"CREATE TABLE `{out_dataset}`.`bad_out` (id STRING, status STRING)")
    with warehouse(bq_endpoint).session() as s:
        with pytest.raises(BatchLLMError, match="different schema: id is STRING, expected INT64"):
            s.ensure_output(output_table(f"{out_dataset}.bad_out"), src)


# -- keys, migration, concurrent partition runs ----------------------------------------------
def result_row(i, key, status="ok", **kw):
    return {"id": i, "partition_key": key, "status": status, "request_hash": f"{key}/{i}"} | kw


OLD_COLUMNS = ", ".join(f"`{c}` {BQ_TYPES[t]}" for c, t in OUTPUT_COLUMNS)


def test_partitions_keep_their_own_rows_and_old_tables_are_reclustered(bq_endpoint, bq, dataset):  # noqa: F811
    src = SourceRef(f"{dataset}.news_headlines", "id", ("headline",), "published_at")
    table = f"{dataset}.old_out"
    # The previous version's table: clustered by id, one row per id.
    query(bq, f"CREATE TABLE `{dataset}`.`old_out` (`id` INT64, {OLD_COLUMNS}) CLUSTER BY `id`")
    query(
        bq,
        f"INSERT INTO `{dataset}`.`old_out` (id, partition_key, status, request_hash) "
        "VALUES (1, 'a', 'ok', 'a/1'), (2, 'a', 'ok', 'a/2')",
    )
    grown = OutputTable(table, (*OUTPUT_COLUMNS, ("label", "string")))
    with warehouse(bq_endpoint).session() as s:
        s.ensure_output(grown, src)
        assert bq.get_table(table).clustering_fields == ["partition_key", "request_hash", "id"]
        # The same ids in partition b are new rows; a's rows are untouched.
        s.write_results(grown, [result_row(1, "b", label="stop"), result_row(2, "b", "failed")])
        assert s.done_hashes(grown, "a", [1, 2, 3]) == {1: "a/1", 2: "a/2"}
        assert s.done_hashes(grown, "b", [1, 2, 3]) == {1: "b/1"}
        s.ensure_output(grown, src)  # idempotent
        changed = OutputTable(table, (*OUTPUT_COLUMNS, ("label", "int")))
        with pytest.raises(BatchLLMError, match="label is STRING, expected INT64"):
            s.ensure_output(changed, src)
    rows = query(
        bq,
        f"SELECT partition_key, id, status, label FROM `{dataset}`.`old_out` ORDER BY 1, 2",
    )
    assert rows == [
        ("a", 1, "ok", None),
        ("a", 2, "ok", None),
        ("b", 1, "ok", "stop"),
        ("b", 2, "failed", None),
    ]


def test_four_concurrent_partition_runs_on_one_output_table(bq_endpoint, bq, dataset):  # noqa: F811
    """Four partition runs, each its own session and thread, write the same ids (1..60) into one
    new output table in interleaved chunks, rewriting some: every partition's rows are there,
    with its own values, and nothing of one partition overwrote another's."""
    src = SourceRef(f"{dataset}.news_headlines", "id", ("headline",), "published_at")
    out = output_table(f"{dataset}.shared_out")
    keys = ["2026-11-01", "2026-11-02", "2026-11-03", "2026-11-04"]
    errors = []
    start = threading.Barrier(len(keys))

    def run(key):
        try:
            with warehouse(bq_endpoint).session() as s:
                start.wait()
                s.ensure_output(out, src)
                for first in range(1, 61, 20):
                    s.write_results(
                        out, [result_row(i, key, "failed") for i in range(first, first + 20)]
                    )
                    s.write_results(out, [result_row(i, key) for i in range(first, first + 20, 2)])
        except Exception as exc:
            errors.append(f"{key}: {exc!r}")

    threads = [threading.Thread(target=run, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    rows = query(
        bq,
        f"SELECT partition_key, COUNT(*), COUNT(DISTINCT id), COUNTIF(status = 'ok'), "
        f"COUNTIF(request_hash = CONCAT(partition_key, '/', CAST(id AS STRING))) "
        f"FROM `{dataset}`.`shared_out` GROUP BY 1 ORDER BY 1",
    )
    assert rows == [(k, 60, 60, 30, 60) for k in keys]
    # Each MERGE reads and writes only its own partition of the target.
    assert "ON T.`partition_key` = @pk AND T.`id` = S.`id`" in bqw_dml.merge_sql(out, "t")


def test_concurrent_update_errors_are_retried(bq_endpoint, bq, dataset, monkeypatch):  # noqa: F811
    """bqemulator runs one statement at a time, so it never answers BigQuery's "could not
    serialize access" or rate-limit errors: those two answers are injected (exceptions shaped
    like BigQuery's error payloads) in front of the emulator, which then runs the MERGE."""
    src = SourceRef(f"{dataset}.news_headlines", "id", ("headline",), "published_at")
    out = output_table(f"{dataset}.retried")
    refusals = [
        gexc.BadRequest(
            "Could not serialize access to table p:d.t due to concurrent update",
            errors=[{"reason": "invalidQuery", "message": "Could not serialize access ..."}],
        ),
        gexc.Forbidden(
            "Exceeded rate limits: too many table update operations for this table",
            errors=[{"reason": "rateLimitExceeded", "message": "Exceeded rate limits"}],
        ),
    ]
    slept = []
    monkeypatch.setattr(bqw_dml, "_sleep", slept.append)
    with warehouse(bq_endpoint).session() as s:
        s.ensure_output(out, src)
        real_query = s._query

        def refusing(sql, params=()):
            if sql.startswith("MERGE") and refusals:
                raise refusals.pop(0)
            return real_query(sql, params)

        monkeypatch.setattr(s, "_query", refusing)
        s.write_results(out, [result_row(i, "p") for i in range(5)])
        assert s.count_output(out.name, "p") == 5
        assert len(slept) == 2 and slept[1] > slept[0] / 2
        # Anything else is not retried: a syntax error fails at once.
        refusals.append(gexc.BadRequest("Syntax error", errors=[{"reason": "invalidQuery"}]))
        with pytest.raises(gexc.BadRequest, match="Syntax error"):
            s.write_results(out, [result_row(9, "p")])
    assert len(slept) == 2
    assert not bqw_dml.is_retryable(ValueError("x"))
    assert bqw_dml.is_retryable(gexc.ServiceUnavailable("backend"))
    # Refused past the deadline: a clear error naming the statement, the last answer attached.
    busy = gexc.Forbidden("Too many DML statements outstanding against table t, limit is 20")

    def always_busy():
        raise busy

    with pytest.raises(BatchLLMError, match=r"MERGE of 3 rows.*Too many DML") as info:
        bqw_dml.run_dml(always_busy, what="MERGE of 3 rows", deadline_s=0)
    assert info.value.__cause__ is busy


# -- UTC-exact slices ----------------------------------------------------------------------------
TICK = timedelta(microseconds=1)
MIDNIGHT = datetime(2026, 11, 1)
# id -> (TIMESTAMP/DATETIME value, DATE value, STRING value), and whether it is in 2026-11-01 UTC.
SLICE_ROWS = [
    (MIDNIGHT - TICK, date(2026, 10, 31), "2026-10-31T23:59:59.999999Z", False),
    (MIDNIGHT, date(2026, 11, 1), "2026-11-01T00:00:00Z", True),
    (MIDNIGHT + timedelta(hours=12), date(2026, 11, 1), "2026-11-01T05:30:00+05:30", True),
    (MIDNIGHT + timedelta(days=1) - TICK, date(2026, 11, 1), "2026-11-01T23:59:59.999999", True),
    (MIDNIGHT + timedelta(days=1), date(2026, 11, 2), "2026-11-01T19:00:00-05:00", False),
    (MIDNIGHT + timedelta(days=1), date(2026, 11, 2), "2026-11-01 05:29:59+05:30", False),
    (MIDNIGHT + timedelta(days=1), date(2026, 11, 2), "2026-11-01", True),
    (MIDNIGHT + timedelta(days=1), date(2026, 11, 2), "2026-11-02 00:00:00 UTC", False),
]


@pytest.fixture(params=["UTC", "America/New_York", "Asia/Kolkata"])
def process_tz(request, monkeypatch):
    monkeypatch.setenv("TZ", request.param)
    time.tzset()
    yield request.param
    monkeypatch.undo()
    time.tzset()


def test_time_window_slices_are_exact_in_utc(process_tz, bq_endpoint, bq, dataset):  # noqa: F811
    query(
        bq,
        f"CREATE TABLE `{dataset}`.`slices` (id INT64, ts TIMESTAMP, dt DATETIME, d DATE, s STRING)",
    )
    rows = [
        bigquery.StructQueryParameter(
            None,
            bigquery.ScalarQueryParameter("id", "INT64", i),
            bigquery.ScalarQueryParameter("ts", "TIMESTAMP", at.replace(tzinfo=UTC)),
            bigquery.ScalarQueryParameter("dt", "DATETIME", at),
            bigquery.ScalarQueryParameter("d", "DATE", day),
            bigquery.ScalarQueryParameter("s", "STRING", text),
        )
        for i, (at, day, text, _) in enumerate(SLICE_ROWS)
    ]
    query(
        bq,
        f"INSERT INTO `{dataset}`.`slices` (id, ts, dt, d, s) "
        "SELECT r.id, r.ts, r.dt, r.d, r.s FROM UNNEST(@rows) AS r",
        [bigquery.ArrayQueryParameter("rows", "STRUCT", rows)],
    )
    day = dict(start=datetime(2026, 11, 1, tzinfo=UTC), end=datetime(2026, 11, 2, tzinfo=UTC))
    by_instant = {
        i for i, (at, *_) in enumerate(SLICE_ROWS) if MIDNIGHT <= at < MIDNIGHT + timedelta(days=1)
    }
    expected = {
        "ts": by_instant,
        "dt": by_instant,
        "d": {i for i, (_, d, *_) in enumerate(SLICE_ROWS) if d == date(2026, 11, 1)},
        "s": {i for i, (*_, inside) in enumerate(SLICE_ROWS) if inside},
    }
    with warehouse(bq_endpoint).session() as s:
        for column, ids in expected.items():
            src = SourceRef(f"{dataset}.slices", "id", ("s",), column)
            where = SliceFilter(column=column, label="2026-11-01", **day)
            assert s.slice_stats(src, where) == (len(ids), [], 0), column
            got = {r["id"] for chunk in s.read_slice(src, where, 3) for r in chunk}
            assert got == ids, (column, process_tz)
        with pytest.raises(BatchLLMError, match=r"slices'.id has type INT64"):
            s.slice_stats(
                SourceRef(f"{dataset}.slices", "id", ("s",), "id"), SliceFilter(column="id", **day)
            )
        ny = ZoneInfo("America/New_York")
        ny_day = SliceFilter(
            column="d", start=datetime(2026, 11, 1, tzinfo=ny), end=datetime(2026, 11, 2, tzinfo=ny)
        )
        with pytest.raises(BatchLLMError, match=r"is a DATE .* not whole UTC days"):
            s.slice_stats(SourceRef(f"{dataset}.slices", "id", ("s",), "d"), ny_day)


def test_write_interval_is_a_setting_of_the_warehouse(bq_endpoint):  # noqa: F811
    """The pipeline's writer waits this long between MERGEs; BigQuery's is longer than DuckDB's."""
    with warehouse(bq_endpoint).session() as s:
        assert s.write_interval_s > DuckDBSession.write_interval_s
    tuned = BigQueryWarehouse(project=PROJECT, api_endpoint=bq_endpoint, write_interval_s=12.5)
    with tuned.session() as s:
        assert s.write_interval_s == 12.5
    with pytest.raises(Exception, match="greater than 0"):
        BigQueryWarehouse(project=PROJECT, api_endpoint=bq_endpoint, write_interval_s=0)
