"""Table and column names as the warehouse resolves them: case, schemas, ambiguity (DuckDB here;
BigQuery's in test_bigquery.py). Identifier patterns and typed-output names:
test_reliability_bad_input_and_secrets.py, test_structured_schema_and_forms.py."""

from __future__ import annotations

import dagster as dg
import duckdb
import pytest

from batch_llm_assets import DuckDBWarehouse, LLMResource, SourceTable, build_llm_batch_asset
from batch_llm_assets.demo_data import create_demo_table
from batch_llm_assets.engine.errors import BatchLLMError
from batch_llm_assets.warehouses.base import SourceRef
from batch_llm_assets.warehouses.duckdb_session import DuckDBSession

from .conftest import SIM_KEY
from .conftest import duckdb_query as query

DAY = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-03")


def run(db, sim, table, *, id_column="id", partition_column="published_at", column="headline"):
    a = build_llm_batch_asset(
        name="sentiment",
        source=SourceTable(
            table=table, id_column=id_column, partition_column=partition_column, columns=[column]
        ),
        prompt=f"{{{{ {column} }}}} Answer with one of: up, down",
        output="news_sentiment",
        partitions_def=DAY,
    )
    resources = {
        "llm": LLMResource(base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini"),
        "warehouse": DuckDBWarehouse(database=db),
    }
    return dg.materialize(
        [a], partition_key="2026-11-01", resources=resources, raise_on_error=False
    )


def failure(result) -> str:
    return result.get_step_failure_events()[0].step_failure_data.error.message


def test_names_that_differ_only_in_case_are_found_as_duckdb_finds_them(fresh_sim, tmp_path):
    """DuckDB matches table and column names ignoring case, quoted or not: so does the run (it
    refused the table as missing before)."""
    db = str(tmp_path / "case.duckdb")
    create_demo_table(db, days=1, per_day=10)
    with duckdb.connect(db) as con:
        con.execute(
            'CREATE TABLE "News_Headlines_V2" AS SELECT id AS "ID", published_at AS '
            '"Published_At", headline AS "HEADLINE" FROM news_headlines'
        )
    result = run(
        db,
        fresh_sim,
        "NEWS_HEADLINES_v2",
        id_column="Id",
        partition_column="published_AT",
        column="Headline",
    )
    assert result.success, failure(result)
    assert query(db, "SELECT count(*), min(status), max(status) FROM news_sentiment") == [
        (10, "ok", "ok")
    ]


def test_a_table_name_in_two_schemas_is_a_clear_error_naming_both(fresh_sim, tmp_path):
    """An unqualified name DuckDB does not find in its schema (main), while two other schemas
    hold it: the run names both and sends nothing (a raw catalog error before)."""
    db = str(tmp_path / "two.duckdb")
    create_demo_table(db, days=1, per_day=5)
    with duckdb.connect(db) as con:
        for schema in ("research", "staging"):
            con.execute(f"CREATE SCHEMA {schema}")
            con.execute(f"CREATE TABLE {schema}.docs AS SELECT * FROM news_headlines")
    result = run(db, fresh_sim, "docs")
    assert not result.success
    message = failure(result)
    assert "two.research.docs and two.staging.docs" in message, message
    assert "Name the one you mean as schema.table" in message
    assert fresh_sim.stats().get("received", 0) == 0
    # Named in full, either one is read.
    assert run(db, fresh_sim, "staging.docs").success


def test_a_name_that_is_both_a_schema_and_a_database_is_a_clear_error(tmp_path):
    """`research.docs` with a schema `research` and an attached database `research`: DuckDB
    refuses to choose (a raw Binder error before); the error names both tables."""
    con = duckdb.connect()
    con.execute(f"ATTACH '{tmp_path / 'research.duckdb'}' AS research")
    con.execute("CREATE TABLE research.main.docs (id BIGINT, headline VARCHAR)")
    con.execute("CREATE SCHEMA memory.research")
    con.execute("CREATE TABLE memory.research.docs (id BIGINT, headline VARCHAR)")
    with pytest.raises(BatchLLMError) as err:
        DuckDBSession(con).check_source(SourceRef("research.docs", "id", ("headline",)))
    message = err.value.description
    assert "ambiguous" in message
    assert "memory.research.docs and research.main.docs" in message
    assert "database.schema.table" in message
    DuckDBSession(con).check_source(SourceRef("memory.research.docs", "id", ("headline",)))
    con.close()
