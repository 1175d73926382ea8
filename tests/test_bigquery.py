"""The batch asset on BigQuery: BigQueryWarehouse against a local bqemulator, the simulator as LLM."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import dagster as dg
import pytest
from google.api_core import exceptions as gexc
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import bigquery

from batch_llm_assets import LLMResource, Prompt, SourceTable, build_llm_batch_asset
from batch_llm_assets.assets.schema import OUTPUT_COLUMNS, output_table
from batch_llm_assets.demo_data import headlines
from batch_llm_assets.engine.errors import BatchLLMError
from batch_llm_assets.resources.bigquery_warehouse import BigQueryWarehouse
from batch_llm_assets.simulator.bqemulator import BigQueryEmulatorProcess
from batch_llm_assets.warehouses import bigquery_dml as bqw_dml
from batch_llm_assets.warehouses import bigquery_session as bqw
from batch_llm_assets.warehouses.base import OutputTable, SliceFilter, SourceRef
from batch_llm_assets.warehouses.bigquery_dml import TYPES as BQ_TYPES
from batch_llm_assets.warehouses.bigquery_names import quote_table, table_parts
from batch_llm_assets.warehouses.duckdb_session import DuckDBSession

from .conftest import SIM_KEY

pytestmark = pytest.mark.bigquery

PROJECT = "test-project"
DAYS = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04")
PROMPT = Prompt(
    system="Reply with one word.",
    template="Headline: {{ headline }}\nAnswer with one of: positive, negative, neutral",
)
PER_DAY = 20


@pytest.fixture(scope="session")
def bq_endpoint(tmp_path_factory):
    """A bqemulator process for the session: its REST base URL."""
    with BigQueryEmulatorProcess(tmp_path_factory.mktemp("bqemulator"), PROJECT) as emulator:
        yield emulator.url


@pytest.fixture
def bq(bq_endpoint):
    client = bigquery.Client(
        project=PROJECT,
        credentials=AnonymousCredentials(),
        client_options=ClientOptions(api_endpoint=bq_endpoint),
    )
    yield client
    client.close()


def query(client, sql, params=()):
    job = client.query(sql, job_config=bigquery.QueryJobConfig(query_parameters=list(params)))
    return [tuple(row.values()) for row in job.result()]


@pytest.fixture
def dataset(bq):
    """A fresh dataset with news_headlines (id INT64, published_at TIMESTAMP, headline STRING)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    query(bq, f"CREATE SCHEMA `{name}`")
    query(
        bq,
        f"CREATE TABLE `{name}`.`news_headlines` "
        "(id INT64, published_at TIMESTAMP, headline STRING)",
    )
    rows = [
        bigquery.StructQueryParameter(
            None,
            bigquery.ScalarQueryParameter("id", "INT64", i),
            bigquery.ScalarQueryParameter("published_at", "TIMESTAMP", at),
            bigquery.ScalarQueryParameter("headline", "STRING", text),
        )
        for i, at, text in headlines(days=3, per_day=PER_DAY)
    ]
    query(
        bq,
        f"INSERT INTO `{name}`.`news_headlines` (id, published_at, headline) "
        "SELECT r.id, r.published_at, r.headline FROM UNNEST(@rows) AS r",
        [bigquery.ArrayQueryParameter("rows", "STRUCT", rows)],
    )
    return name


def asset(dataset, **kw):
    settings = dict(
        name="sentiment",
        source=SourceTable(
            table=f"{dataset}.news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=PROMPT,
        output=f"{dataset}.news_sentiment",
        params={"max_tokens": 5},
        partitions_def=DAYS,
        chunk_rows=8,  # 20 rows a day: the slice is read in several pages
    )
    return build_llm_batch_asset(**(settings | kw))


def warehouse(bq_endpoint):
    return BigQueryWarehouse(project=PROJECT, api_endpoint=bq_endpoint)


def materialize(a, sim, bq_endpoint, key="2026-11-01", **llm):
    resources = {
        "llm": LLMResource(
            base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini", **({"max_attempts": 3} | llm)
        ),
        "warehouse": warehouse(bq_endpoint),
    }
    return dg.materialize([a], resources=resources, partition_key=key, raise_on_error=False)


def metadata(result, name="sentiment"):
    mats = result.asset_materializations_for_node(name)
    return {k: v.value for k, v in mats[-1].metadata.items()}


def failure_message(result):
    return result.get_step_failure_events()[0].step_failure_data.error.message


def day_ids(day):
    start = datetime.fromisoformat(day).replace(tzinfo=UTC)
    return {i for i, at, _ in headlines(days=3, per_day=PER_DAY) if 0 <= (at - start).days < 1}


def test_round_trip_one_daily_partition(fresh_sim, bq_endpoint, bq, dataset):
    result = materialize(asset(dataset), fresh_sim, bq_endpoint)
    assert result.success, failure_message(result)
    md = metadata(result)
    assert md["partition/rows_input"] == md["partition/rows_ok"] == PER_DAY
    assert md["run/rows_ok"] == md["dagster/row_count"] == PER_DAY
    assert md["partition/rows_failed"] == 0 and md["run/rows_skipped"] == 0
    rows = query(
        bq,
        f"SELECT id, status, response, partition_key, model, request_hash, completed_at "
        f"FROM `{dataset}`.`news_sentiment` ORDER BY id",
    )
    assert {r[0] for r in rows} == day_ids("2026-11-01") and len(rows) == PER_DAY
    assert {r[1] for r in rows} == {"ok"}
    assert {r[2] for r in rows} <= {"positive", "negative", "neutral"}
    assert {r[3] for r in rows} == {"2026-11-01"} and {r[4] for r in rows} == {"gpt-4o-mini"}
    assert all(len(r[5]) == 64 and isinstance(r[6], datetime) for r in rows)
    # Only that day's slice was read and sent.
    assert fresh_sim.stats()["answered"] == PER_DAY
    # The output table: the source id's type and the OUTPUT_COLUMNS types.
    schema = {f.name: f.field_type for f in bq.get_table(f"{dataset}.news_sentiment").schema}
    assert schema["id"] == "INTEGER" and schema["partition_key"] == "STRING"
    assert schema["prompt_tokens"] == "INTEGER" and schema["cost_usd"] == "FLOAT"
    assert schema["completed_at"] == "TIMESTAMP"
    # Another day adds its own rows only.
    assert materialize(asset(dataset), fresh_sim, bq_endpoint, key="2026-11-02").success
    counts = query(
        bq,
        f"SELECT partition_key, COUNT(*) FROM `{dataset}`.`news_sentiment` "
        "GROUP BY partition_key ORDER BY partition_key",
    )
    assert counts == [("2026-11-01", PER_DAY), ("2026-11-02", PER_DAY)]


def test_rerun_skips_done_rows_without_duplicates(fresh_sim, bq_endpoint, bq, dataset):
    assert materialize(asset(dataset), fresh_sim, bq_endpoint).success
    second = materialize(asset(dataset), fresh_sim, bq_endpoint)
    assert second.success
    md = metadata(second)
    assert md["run/rows_skipped"] == PER_DAY and md["run/rows_ok"] == 0
    assert md["partition/rows_ok"] == md["dagster/row_count"] == PER_DAY
    assert fresh_sim.stats()["answered"] == PER_DAY  # nothing was sent again
    sql = f"SELECT COUNT(*), COUNT(DISTINCT id) FROM `{dataset}`.`news_sentiment`"
    assert query(bq, sql) == [(PER_DAY, PER_DAY)]
    # A changed prompt is new work: every row is sent again and replaced, still one row per id.
    changed = asset(dataset, prompt=Prompt(template="Sentiment of: {{ headline }}"), params={})
    md = metadata(materialize(changed, fresh_sim, bq_endpoint))
    assert md["run/rows_ok"] == PER_DAY and md["run/rows_skipped"] == 0
    assert query(bq, sql) == [(PER_DAY, PER_DAY)]


def test_failed_rows_are_replaced_on_rerun(fresh_sim, bq_endpoint, bq, dataset):
    fresh_sim.configure(fail_503=1.0)
    first = materialize(asset(dataset), fresh_sim, bq_endpoint, max_attempts=1)
    assert not first.success
    assert f"{PER_DAY} of the partition's {PER_DAY} rows have failed" in failure_message(first)
    table = f"`{dataset}`.`news_sentiment`"
    assert query(bq, f"SELECT status, error_class, COUNT(*) FROM {table} GROUP BY 1, 2") == [
        ("failed", "server_error", PER_DAY)
    ]
    fresh_sim.configure(fail_503=0.0)
    md = metadata(materialize(asset(dataset), fresh_sim, bq_endpoint))
    assert md["run/rows_ok"] == PER_DAY and md["run/rows_skipped"] == 0
    assert query(bq, f"SELECT status, COUNT(*), COUNT(DISTINCT id) FROM {table} GROUP BY 1") == [
        ("ok", PER_DAY, PER_DAY)
    ]
    assert query(bq, f"SELECT COUNTIF(error_class IS NOT NULL) FROM {table}") == [(0,)]


def test_static_partition_on_a_string_column(fresh_sim, bq_endpoint, bq, dataset):
    query(bq, f"CREATE TABLE `{dataset}`.`tickets` (ticket_id STRING, region STRING, body STRING)")
    query(
        bq,
        f"INSERT INTO `{dataset}`.`tickets` (ticket_id, region, body) "
        "SELECT CAST(i AS STRING), IF(MOD(i, 2) = 1, 'eu', 'us'), CONCAT('ticket ', CAST(i AS STRING)) "
        "FROM UNNEST(@ids) AS i",
        [bigquery.ArrayQueryParameter("ids", "INT64", list(range(10)))],
    )
    a = build_llm_batch_asset(
        name="triage",
        source=SourceTable(
            table=f"{dataset}.tickets", id_column="ticket_id", partition_column="region"
        ),
        prompt="Classify: {{ body }}",
        output=f"{dataset}.triage_out",
        partitions_def=dg.StaticPartitionsDefinition(["eu", "us"]),
    )
    result = materialize(a, fresh_sim, bq_endpoint, key="eu")
    assert result.success, failure_message(result)
    assert metadata(result, "triage")["partition/rows_ok"] == 5
    rows = query(bq, f"SELECT id FROM `{dataset}`.`triage_out` ORDER BY id")
    assert rows == [("1",), ("3",), ("5",), ("7",), ("9",)]  # STRING ids, the source's type


def test_session_reads_pages_and_filters_by_parameters(bq_endpoint, bq, dataset):
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


def test_writes_merge_in_bounded_chunks_and_upsert(bq_endpoint, bq, dataset, monkeypatch):
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


def test_missing_dataset_table_or_column_is_a_clear_error(fresh_sim, bq_endpoint, dataset):
    cases = [
        (
            SourceTable(
                table="no_such_dataset.news_headlines",
                partition_column="published_at",
                columns=["headline"],
            ),
            "dataset test-project.no_such_dataset",
        ),
        (
            SourceTable(
                table=f"{dataset}.no_such_table",
                partition_column="published_at",
                columns=["headline"],
            ),
            "no_such_table",
        ),
        (
            SourceTable(
                table=f"{dataset}.news_headlines",
                partition_column="published_at",
                columns=["headline", "body"],
            ),
            "'body'",
        ),
        (
            SourceTable(
                table=f"{dataset}.news_headlines", partition_column="day", columns=["headline"]
            ),
            "'day'",
        ),
    ]
    for source, named in cases:
        a = asset(dataset, source=source, prompt=Prompt(template="{{ headline }}"))
        result = materialize(a, fresh_sim, bq_endpoint)
        assert not result.success
        assert named in failure_message(result)
    assert fresh_sim.stats().get("received", 0) == 0


def test_column_names_are_matched_ignoring_case_as_bigquery_does(fresh_sim, bq_endpoint, dataset):
    """BigQuery's column names ignore case (its table and dataset names do not, and the tables
    API resolves those): columns named in another case are read (refused as missing before)."""
    source = SourceTable(
        table=f"{dataset}.news_headlines",
        id_column="ID",
        partition_column="Published_At",
        columns=["HEADLINE"],
    )
    template = PROMPT.template.replace("{{ headline }}", "{{ HEADLINE }}")
    a = asset(dataset, source=source, prompt=Prompt(system=PROMPT.system, template=template))
    result = materialize(a, fresh_sim, bq_endpoint)
    assert result.success, failure_message(result)
    assert metadata(result)["partition/rows_ok"] == len(day_ids("2026-11-01"))


BAD_NAMES = ["ds.news`s", 'ds."x"', "ds.t; DROP TABLE x", "ds.t` ; DROP TABLE x; --", "a.b.c.d"]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_unsafe_identifiers_are_refused(bad, bq_endpoint, bq, dataset):
    before = sorted(d.dataset_id for d in bq.list_datasets())
    with pytest.raises(BatchLLMError, match="Invalid table"):
        asset(
            dataset,
            source=SourceTable(table=bad, partition_column="published_at", columns=["headline"]),
        )
    with pytest.raises(BatchLLMError, match="Invalid table"):
        asset(dataset, output=bad)
    # The session checks names itself too (it may be used without the factory).
    src = SourceRef(f"{dataset}.news_headlines", "id", ("headline",), "published_at")
    with warehouse(bq_endpoint).session() as s:
        with pytest.raises(BatchLLMError, match="Invalid"):
            s.check_source(SourceRef(bad, "id", ("headline",)))
        with pytest.raises(BatchLLMError, match="Invalid"):
            s.ensure_output(output_table(bad), src)
        with pytest.raises(BatchLLMError, match="Invalid"):
            s.write_results(output_table(bad), [{"id": 1}])
        with pytest.raises(BatchLLMError, match="Invalid column"):
            s.check_source(SourceRef(src.table, "id", ("headline`; SELECT 1",)))
    assert sorted(d.dataset_id for d in bq.list_datasets()) == before
    assert [t.table_id for t in bq.list_tables(dataset)] == ["news_headlines"]


@pytest.mark.parametrize(
    "bad",
    [
        "proj`ect.ds.t",
        "Bad-Project.ds.t",
        "p';x.ds.t",
        "short.ds.t",
        "-my-project.ds.t",
        "news",
        "",
    ],
)
def test_table_names_need_a_dataset_and_a_valid_project(bad):
    with pytest.raises(BatchLLMError, match="Invalid"):
        table_parts(bad)


def test_project_ids_may_contain_hyphens():
    assert table_parts("my-project-42.analytics.news") == ("my-project-42", "analytics", "news")
    assert table_parts("analytics.news") == (None, "analytics", "news")
    assert quote_table("my-project-42.analytics.news") == "`my-project-42`.`analytics`.`news`"


def test_output_dataset_is_created_and_tables_are_listed(bq_endpoint, bq, dataset):
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


def test_partitions_keep_their_own_rows_and_old_tables_are_reclustered(bq_endpoint, bq, dataset):
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


def test_four_concurrent_partition_runs_on_one_output_table(bq_endpoint, bq, dataset):
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


def test_concurrent_update_errors_are_retried(bq_endpoint, bq, dataset, monkeypatch):
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


def test_time_window_slices_are_exact_in_utc(process_tz, bq_endpoint, bq, dataset):
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


def test_one_table_per_partition_keeps_every_partition(fresh_sim, bq_endpoint, bq, dataset):
    """The new-input-tables pattern on BigQuery: ids 1..5 in every table, the same texts in both;
    each partition keeps its own rows and the second table is answered, not 'skipped'."""
    for name in ("t1", "t2"):
        query(
            bq,
            f"CREATE TABLE `{dataset}`.`{name}` AS SELECT id, CONCAT('headline ', "
            "CAST(id AS STRING)) AS headline FROM UNNEST(GENERATE_ARRAY(1, 5)) AS id",
        )
    tables = dg.DynamicPartitionsDefinition(name="input_tables")
    a = asset(
        dataset,
        source=SourceTable(table=f"{dataset}.{{partition_key}}", columns=["headline"]),
        partitions_def=tables,
    )
    resources = {
        "llm": LLMResource(base_url=fresh_sim.url, api_key=SIM_KEY, model="gpt-4o-mini"),
        "warehouse": warehouse(bq_endpoint),
    }
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("input_tables", ["t1", "t2"])
        for key in ("t1", "t2"):
            result = dg.materialize([a], instance=instance, partition_key=key, resources=resources)
            md = metadata(result)
            assert md["run/rows_ok"] == 5 and md["run/rows_skipped"] == 0, key
    rows = query(
        bq,
        f"SELECT partition_key, COUNT(*), COUNT(DISTINCT id) FROM `{dataset}`.`news_sentiment` "
        "GROUP BY 1 ORDER BY 1",
    )
    assert rows == [("t1", 5, 5), ("t2", 5, 5)]
    assert fresh_sim.stats()["answered"] == 10


def test_write_interval_is_a_setting_of_the_warehouse(bq_endpoint):
    """The pipeline's writer waits this long between MERGEs; BigQuery's is longer than DuckDB's."""
    with warehouse(bq_endpoint).session() as s:
        assert s.write_interval_s > DuckDBSession.write_interval_s
    tuned = BigQueryWarehouse(project=PROJECT, api_endpoint=bq_endpoint, write_interval_s=12.5)
    with tuned.session() as s:
        assert s.write_interval_s == 12.5
    with pytest.raises(Exception, match="greater than 0"):
        BigQueryWarehouse(project=PROJECT, api_endpoint=bq_endpoint, write_interval_s=0)


# -- identical requests sent once (issue 30) ---------------------------------------------------


def test_answers_stored_in_one_partition_are_reused_by_another(fresh_sim, bq_endpoint, bq, dataset):
    """Day 1 repeats some of its headlines; day 2 repeats half of day 1's: each identity is sent
    once, found again with one lookup per chunk (clustered by partition_key, request_hash)."""
    day1 = [f"a{i % 12} shares move" for i in range(20)]  # 12 distinct
    day2 = [f"a{i} shares move" for i in range(6)] + [f"b{i % 6} shares move" for i in range(14)]
    rows = [
        bigquery.StructQueryParameter(
            None,
            bigquery.ScalarQueryParameter("id", "INT64", 1000 + 100 * d + n),
            bigquery.ScalarQueryParameter(
                "published_at", "TIMESTAMP", datetime(2026, 11, 1 + d, 1, n, tzinfo=UTC)
            ),
            bigquery.ScalarQueryParameter("headline", "STRING", text),
        )
        for d, texts in enumerate((day1, day2))
        for n, text in enumerate(texts)
    ]
    query(
        bq,
        f"CREATE TABLE `{dataset}`.`repeats` AS SELECT r.id, r.published_at, r.headline "
        "FROM UNNEST(@rows) AS r",
        [bigquery.ArrayQueryParameter("rows", "STRUCT", rows)],
    )
    source = SourceTable(
        table=f"{dataset}.repeats", partition_column="published_at", columns=["headline"]
    )
    a = asset(dataset, source=source, params={"max_tokens": 5, "temperature": 0})
    assert materialize(a, fresh_sim, bq_endpoint).success
    assert fresh_sim.stats()["received"] == 12
    second = materialize(a, fresh_sim, bq_endpoint, key="2026-11-02")
    assert second.success
    assert fresh_sim.stats()["received"] == 12 + 6  # day 2's new requests only
    md = metadata(second)
    assert md["run/answers_reused"] == 6 and md["run/requests_deduplicated"] == 8
    out = query(
        bq,
        f"SELECT o.partition_key, o.id, o.shared_from, o.cost_usd, o.response, s.headline "
        f"FROM `{dataset}`.`news_sentiment` o JOIN `{dataset}`.`repeats` s ON s.id = o.id "
        "ORDER BY o.partition_key, o.id",
    )
    assert len(out) == 40
    payers = {r[5]: r for r in out if r[2] is None}
    assert len(payers) == 18
    for pk, _rid, shared_from, cost, response, headline in out:
        if shared_from is not None:
            source_row = payers[headline]
            prefix = "" if source_row[0] == pk else f"{source_row[0]}/"
            assert shared_from == f"{prefix}{source_row[1]}" and cost == 0
            assert response == source_row[4]
    # Clustered for the lookup; a rerun of day 2 sends nothing.
    assert bq.get_table(f"{dataset}.news_sentiment").clustering_fields == [
        "partition_key",
        "request_hash",
        "id",
    ]
    assert materialize(a, fresh_sim, bq_endpoint, key="2026-11-02").success
    assert fresh_sim.stats()["received"] == 18
