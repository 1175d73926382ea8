"""DuckDB as the warehouse: output keyed by (partition_key, id), migration of older output tables,
new and changed output columns, ids that cannot key a row. UTC-exact time-window slices are in
test_duckdb_time_slices.py."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime

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
from batch_llm_assets.assets.schema import OUTPUT_COLUMNS, output_table
from batch_llm_assets.engine.errors import BatchLLMError
from batch_llm_assets.warehouses.base import OutputTable, SliceFilter, SourceRef
from batch_llm_assets.warehouses.duckdb_session import DuckDBSession

from .conftest import SIM_KEY
from .conftest import duckdb_query as query

TABLES = dg.DynamicPartitionsDefinition(name="input_tables")
N = 6


def llm(sim):
    return LLMResource(base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini", max_attempts=3)


# -- keys ------------------------------------------------------------------------------------
def test_one_table_per_partition_keeps_every_partition(tmp_path, fresh_sim):
    """Ids 1..N in every input table: each partition keeps its own N rows, and a new table whose
    rows equal an older table's is answered, not 'skipped' as done."""
    db = str(tmp_path / "w.duckdb")
    tables = ["t1", "t2", "t3"]
    with duckdb.connect(db) as con:
        con.execute("CREATE SCHEMA incoming")
        for name in tables:  # t1 and t2 hold the very same rows
            text = "'headline ' || range" if name != "t3" else "'other ' || range"
            con.execute(
                f"CREATE TABLE incoming.{name} AS SELECT range + 1 AS id, {text} AS headline "
                f"FROM range({N})"
            )
    a = build_llm_batch_asset(
        name="incoming_sentiment",
        source=SourceTable(table="incoming.{partition_key}", columns=["headline"]),
        prompt=Prompt(template="{{ headline }} Answer with one of: up, down"),
        output="incoming_sentiment",
        partitions_def=TABLES,
    )
    resources = {"llm": llm(fresh_sim), "warehouse": DuckDBWarehouse(database=db)}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("input_tables", tables)
        for key in tables:
            result = dg.materialize([a], instance=instance, partition_key=key, resources=resources)
            md = result.asset_materializations_for_node("incoming_sentiment")[0].metadata
            assert md["run/rows_ok"].value == N and md["run/rows_skipped"].value == 0, key
        # A rerun of one partition skips exactly its own rows.
        again = dg.materialize([a], instance=instance, partition_key="t2", resources=resources)
        md = again.asset_materializations_for_node("incoming_sentiment")[0].metadata
        assert md["run/rows_skipped"].value == N and md["run/rows_ok"].value == 0
    counts = query(
        db,
        "SELECT partition_key, count(*), count(DISTINCT id) FROM incoming_sentiment "
        "GROUP BY 1 ORDER BY 1",
    )
    assert counts == [(t, N, N) for t in tables]
    assert fresh_sim.stats()["answered"] == len(tables) * N


OLD_DDL = """CREATE TABLE out (id BIGINT PRIMARY KEY, partition_key VARCHAR, response VARCHAR,
    status VARCHAR, error_class VARCHAR, error VARCHAR, model VARCHAR, prompt_tokens BIGINT,
    completion_tokens BIGINT, cost_usd DOUBLE, latency_ms DOUBLE, attempts BIGINT,
    request_hash VARCHAR, completed_at TIMESTAMPTZ)"""


def result_row(i, key, status="ok", **kw):
    return {"id": i, "partition_key": key, "status": status, "request_hash": f"h{key}{i}"} | kw


@pytest.fixture
def con():
    conn = duckdb.connect()
    conn.execute("CREATE TABLE src (id BIGINT, headline VARCHAR)")
    yield conn
    conn.close()


SRC = SourceRef("src", "id", ("headline",))


def primary_key(conn, table="out"):
    return conn.execute(
        "SELECT constraint_column_names FROM duckdb_constraints() "
        "WHERE table_name = ? AND constraint_type = 'PRIMARY KEY'",
        [table],
    ).fetchone()[0]


def test_an_output_table_keyed_by_id_is_rebuilt_with_the_partition_key(con):
    con.execute(OLD_DDL)  # the previous version's layout
    con.execute(
        "INSERT INTO out (id, partition_key, status, request_hash) VALUES (1, 'a', 'ok', 'x')"
    )
    con.execute(
        "INSERT INTO out (id, partition_key, status, request_hash) VALUES (2, 'a', 'ok', 'y')"
    )
    s = DuckDBSession(con)
    s.ensure_output(output_table("out"), SRC)
    assert primary_key(con) == ["partition_key", "id"]
    assert con.execute(
        "SELECT id, partition_key, request_hash FROM out ORDER BY id"
    ).fetchall() == [
        (1, "a", "x"),
        (2, "a", "y"),
    ]
    # The same ids in another partition are new rows; partition a is untouched.
    s.write_results(output_table("out"), [result_row(1, "b"), result_row(2, "b", "failed")])
    assert s.count_output("out", "a") == s.count_output("out", "b") == 2
    assert s.done_hashes(output_table("out"), "a", [1, 2, 3]) == {1: "x", 2: "y"}
    assert s.done_hashes(output_table("out"), "b", [1, 2, 3]) == {1: "hb1"}
    s.ensure_output(output_table("out"), SRC)  # idempotent
    assert con.execute("SELECT count(*) FROM out").fetchone() == (4,)


def test_chunks_are_written_through_arrow_with_the_same_values_as_through_pandas(con):
    """DuckDB scans an Arrow table without the GIL (the event loop keeps receiving answers
    while a chunk is written); values Arrow will not take as typed go through pandas. Both
    must store the same thing, typed-output columns (json, lists, bools) included."""
    from batch_llm_assets.warehouses import duckdb_session as ds

    typed = (("label", "string"), ("score", "float"), ("n", "int"), ("flag", "bool"))
    typed += (("extra", "json"), ("tags", "list<string>"))
    out = output_table("out", typed)
    s = DuckDBSession(con)
    s.ensure_output(out, SRC)
    now = datetime(2026, 11, 1, 23, 59, 59, 123456, tzinfo=UTC)

    def rows(key):
        return [
            result_row(
                1,
                key,
                response="é",
                prompt_tokens=3,
                cost_usd=None,
                completed_at=now,
                label="up",
                score=0.5,
                n=2,
                flag=True,
                extra='{"a": 1}',
                tags=["x", "y"],
            ),
            result_row(2, key, "failed", error="x", latency_ms=3, n=None, flag=None, tags=None),
        ]

    assert ds.arrow_table(out, rows("a")).num_rows == 2  # ordinary rows take the Arrow path
    s.write_results(out, rows("a"))
    real = ds.arrow_table
    ds.arrow_table = None  # calling it fails: the pandas path
    try:
        s.write_results(out, rows("b"))
    finally:
        ds.arrow_table = real
    cols = ", ".join(c for c in out.names[2:] if c != "request_hash")  # hash names the key
    by_key = {
        k: con.execute(
            f"SELECT id, {cols} FROM out WHERE partition_key = ? ORDER BY id", [k]
        ).fetchall()
        for k in ("a", "b")
    }
    assert by_key["a"] == by_key["b"] and len(by_key["a"]) == 2
    assert now in by_key["a"][0] and ["x", "y"] in by_key["a"][0]


def test_an_old_table_that_cannot_be_rekeyed_is_left_as_it_was(con):
    con.execute(OLD_DDL)
    con.execute(
        "INSERT INTO out (id, partition_key, status) VALUES (1, NULL, 'ok'), (2, 'a', 'ok')"
    )
    with pytest.raises(BatchLLMError, match=r"keyed by id alone .* NULL partition_key"):
        DuckDBSession(con).ensure_output(output_table("out"), SRC)
    assert primary_key(con) == ["id"]
    assert con.execute("SELECT count(*) FROM out").fetchone() == (2,)
    tables = con.execute("SELECT table_name FROM information_schema.tables ORDER BY 1").fetchall()
    assert tables == [("out",), ("src",)]
    con.execute("CREATE TABLE older (id BIGINT PRIMARY KEY, status VARCHAR)")
    with pytest.raises(BatchLLMError, match="no partition_key column"):
        DuckDBSession(con).ensure_output(output_table("older"), SRC)
    assert primary_key(con, "older") == ["id"]


def test_a_table_with_another_key_is_refused(con):
    con.execute(
        "CREATE TABLE out (id BIGINT, partition_key VARCHAR, model VARCHAR, "
        "PRIMARY KEY (id, model))"
    )
    with pytest.raises(BatchLLMError, match=r"primary key \['id', 'model'\].*PRIMARY KEY"):
        DuckDBSession(con).ensure_output(output_table("out"), SRC)
    # The same two columns in the other order are the same key: taken as it is.
    con.execute(
        "CREATE TABLE out2 (id BIGINT, partition_key VARCHAR, PRIMARY KEY (id, partition_key))"
    )
    DuckDBSession(con).ensure_output(output_table("out2"), SRC)


def test_new_output_columns_are_added_and_changed_types_refused(con):
    s = DuckDBSession(con)
    s.ensure_output(output_table("out"), SRC)
    s.write_results(output_table("out"), [result_row(1, "a", response="r")])
    grown = OutputTable("out", (*OUTPUT_COLUMNS, ("label", "string"), ("score", "float")))
    s.ensure_output(grown, SRC)
    types = dict(
        con.execute(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'out'"
        ).fetchall()
    )
    assert types["label"] == "VARCHAR" and types["score"] == "DOUBLE"
    assert con.execute("SELECT response, label FROM out").fetchall() == [("r", None)]
    s.write_results(grown, [result_row(2, "a", label="up", score=1.5)])
    assert con.execute("SELECT label, score FROM out WHERE id = 2").fetchone() == (
        "up",
        1.5,
    )
    changed = OutputTable("out", (*OUTPUT_COLUMNS, ("label", "int")))
    with pytest.raises(BatchLLMError, match="label is VARCHAR, expected BIGINT"):
        s.ensure_output(changed, SRC)


# -- ids that cannot key a row ---------------------------------------------------------------
def test_nan_and_infinite_ids_are_refused_before_anything_is_sent(tmp_path, fresh_sim):
    db = str(tmp_path / "w.duckdb")
    with duckdb.connect(db) as con:
        con.execute("CREATE TABLE t (id DOUBLE, headline VARCHAR, region VARCHAR DEFAULT 'eu')")
        con.execute(
            "INSERT INTO t (id, headline) VALUES (1, 'a'), ('nan', 'b'), ('inf', 'c'), ('-inf', 'd'), "
            "(NULL, 'e'), (2, 'f'), (2, 'g')"
        )
        s = DuckDBSession(con)
        rows, dups, bad = s.slice_stats(SourceRef("t", "id", ("headline",)), SliceFilter())
        assert (rows, dups, bad) == (7, [2.0], 4)
    a = build_llm_batch_asset(
        name="s",
        source=SourceTable(table="t", partition_column="region", columns=["headline"]),
        prompt="{{ headline }}",
        output="o",
        partitions_def=dg.StaticPartitionsDefinition(["eu"]),
    )
    result = dg.materialize(
        [a],
        partition_key="eu",
        resources={"llm": llm(fresh_sim), "warehouse": DuckDBWarehouse(database=db)},
        raise_on_error=False,
    )
    assert not result.success
    message = result.get_step_failure_events()[0].step_failure_data.error.message
    assert "4 row(s)" in message and "NULL 'id' (or a NaN or infinite one)" in message
    assert fresh_sim.stats().get("received", 0) == 0


def test_defining_assets_imports_neither_the_bigquery_client_nor_pandas():
    """Every Dagster process (the run, each step, `dg`) loads the definitions: the BigQuery
    client is imported only by a run that writes to BigQuery, pandas only where a data frame is
    built."""
    code = (
        "import sys, batch_llm_assets.definitions, batch_llm_assets.embeddings\n"
        "print(sorted(m for m in sys.modules if m.startswith(('google.cloud.bigquery', 'pandas'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
