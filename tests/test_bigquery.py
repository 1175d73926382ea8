"""The batch asset on BigQuery: BigQueryWarehouse against a local bqemulator, the simulator as LLM:
runs of a partition, reruns, one table per partition, answers reused across partitions. Its
fixtures and helpers (bq_endpoint, bq, dataset, asset, materialize) serve the other modules."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import dagster as dg
import pytest
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import bigquery

from batch_llm_assets import LLMResource, Prompt, SourceTable, build_llm_batch_asset
from batch_llm_assets.demo_data import headlines
from batch_llm_assets.resources.bigquery_warehouse import BigQueryWarehouse
from batch_llm_assets.simulator.bqemulator import BigQueryEmulatorProcess

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
