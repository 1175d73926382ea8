"""The batch asset on BigQuery: BigQueryWarehouse against a local bqemulator, the simulator as LLM."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime

import dagster as dg
import pytest
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import bigquery

from batch_llm_assets import LLMResource, Prompt, SourceTable, build_llm_batch_asset
from batch_llm_assets.assets.schema import output_table
from batch_llm_assets.demo_data import headlines
from batch_llm_assets.engine.errors import BatchLLMError
from batch_llm_assets.resources.bigquery_warehouse import BigQueryWarehouse
from batch_llm_assets.warehouses import bigquery_session as bqw
from batch_llm_assets.warehouses.base import SliceFilter, SourceRef
from batch_llm_assets.warehouses.bigquery_session import table_parts

from .conftest import SIM_KEY

pytestmark = pytest.mark.bigquery

PROJECT = "test-project"
DAYS = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04")
PROMPT = Prompt(
    system="Reply with one word.",
    template="Headline: {{ headline }}\nAnswer with one of: positive, negative, neutral",
)
PER_DAY = 20

# The emulator's own process. bqemulator has no flag, BQEMU_* variable or hook to skip loading
# DuckDB's spatial extension at boot (DuckDBEngine.start always runs INSTALL/LOAD spatial, which
# downloads it and fails offline), so this launcher replaces that one step with a no-op before
# the server is built: GEOGRAPHY is not needed. The Avro extension download is switched off with
# its documented setting (enable_format_extensions=False). The REST port, chosen free by the OS,
# is written to argv[1]; the emulator stops when stdin closes (or on SIGTERM/SIGINT).
LAUNCHER = r"""
import asyncio, os, signal, sys
from bqemulator.config import Settings
from bqemulator.server import EmulatorServer
from bqemulator.storage.engine import DuckDBEngine

DuckDBEngine._load_spatial = lambda self: None  # monkeypatch: see the comment in the test file

async def main(port_file):
    server = EmulatorServer(Settings(
        rest_host="127.0.0.1", rest_port=0, grpc_host="127.0.0.1", grpc_port=0,
        enable_format_extensions=False, default_project_id=sys.argv[2],
        log_level="warning", log_format="console", metrics_enabled=False,
    ))
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.run_in_executor(None, lambda: (sys.stdin.read(), loop.call_soon_threadsafe(stop.set)))
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.rest_port))
    os.replace(port_file + ".tmp", port_file)
    try:
        await stop.wait()
    finally:
        await server.stop()

asyncio.run(main(sys.argv[1]))
os._exit(0)  # don't wait for the stdin reader thread
"""


@pytest.fixture(scope="session")
def bq_endpoint(tmp_path_factory):
    """A bqemulator process for the session: its REST base URL."""
    workdir = tmp_path_factory.mktemp("bqemulator")
    port_file = workdir / "port"
    log_path = workdir / "emulator.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(port_file), PROJECT],
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,  # so no .bqemu.toml of the repo's is picked up
        )
    try:
        deadline = time.monotonic() + 90
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"bqemulator did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}"
    finally:
        proc.stdin.close()  # the launcher stops on EOF
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
    sent = []
    with warehouse(bq_endpoint).session() as s:
        original = s._write_chunk
        monkeypatch.setattr(s, "_write_chunk", lambda t, c: (sent.append(len(c)), original(t, c)))
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
    assert bqw._qt("my-project-42.analytics.news") == "`my-project-42`.`analytics`.`news`"


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
