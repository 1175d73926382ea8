"""Reliability and security against bad input and for secrets: bad data handled row by row,
duplicate, NULL and missing ids failing the run before any request, a planted key appearing
nowhere, names that carry SQL refused (a hyphen passing only in a BigQuery project id), and
templates that cannot include files or reach Python. Helpers are test_reliability.py's; the
figures are recorded in docs/reliability.md."""

from __future__ import annotations

import json
import logging

import dagster as dg
import duckdb
import pytest

from batch_llm_assets import DuckDBWarehouse, Prompt, SourceTable, build_llm_batch_asset
from batch_llm_assets.demo_data import create_demo_table
from batch_llm_assets.engine.errors import BatchLLMError

from .conftest import duckdb_query as query
from .test_reliability import DAY, llm, sentiment

pytestmark = pytest.mark.reliability


# -- bad data ---------------------------------------------------------------------------------


def test_bad_data_is_handled_row_by_row(fresh_sim, tmp_path):
    db = str(tmp_path / "bad.duckdb")
    con = duckdb.connect(db)
    con.execute("CREATE TABLE docs (id BIGINT, day DATE, body BLOB)")
    rows = [
        (1, "2026-11-01", b"caf\xe9 \xff\xfe broken utf-8"),
        (2, "2026-11-01", ("word " * 200_000).encode()),  # 1 MB
        (3, "2026-11-01", "Rally 🚀📈 مرحبا بالعالم שלום".encode()),
        (4, "2026-11-01", None),
        (5, None, b"no partition value"),
    ]
    con.executemany("INSERT INTO docs VALUES (?, ?, ?)", rows)
    con.close()
    a = build_llm_batch_asset(
        name="docs_out",
        source=SourceTable(table="docs", partition_column="day"),
        prompt="Summarise: {{ body }}",
        output="docs_out",
        partitions_def=DAY,
        max_failed_fraction=1.0,
    )
    resources = {
        "llm": llm(fresh_sim, context_window=100_000),
        "warehouse": DuckDBWarehouse(database=db),
    }
    result = dg.materialize([a], partition_key="2026-11-01", resources=resources)
    out = dict(query(db, "SELECT id, coalesce(error_class, status) FROM docs_out"))
    # 2: 1 MB is over 8 characters per token of the 100k window: refused before tokenizing.
    assert out == {1: "ok", 2: "prompt_too_large", 3: "ok", 4: "empty_prompt"}  # 5: no partition
    # An empty partition succeeds with 0 rows.
    empty = dg.materialize([a], partition_key="2026-11-02", resources=resources)
    md = empty.asset_materializations_for_node("docs_out")[0].metadata
    assert md["partition/rows_input"].value == 0 and md["dagster/row_count"].value == 0
    assert result.success


def test_duplicate_and_null_ids_and_missing_id_column_fail_before_any_request(fresh_sim, tmp_path):
    db = str(tmp_path / "ids.duckdb")
    create_demo_table(db, days=1, per_day=10)
    con = duckdb.connect(db)
    con.execute("UPDATE news_headlines SET id = 1 WHERE id = 2")
    con.close()
    resources = {"llm": llm(fresh_sim), "warehouse": DuckDBWarehouse(database=db)}
    dup = dg.materialize(
        [sentiment()], partition_key="2026-11-01", resources=resources, raise_on_error=False
    )
    assert "Duplicate ids" in dup.get_step_failure_events()[0].step_failure_data.error.message
    con = duckdb.connect(db)
    con.execute("UPDATE news_headlines SET id = NULL WHERE id = 1")
    con.close()
    null = dg.materialize(
        [sentiment()], partition_key="2026-11-01", resources=resources, raise_on_error=False
    )
    assert "NULL 'id'" in null.get_step_failure_events()[0].step_failure_data.error.message
    missing = sentiment(
        source=SourceTable(
            table="news_headlines",
            id_column="uid",
            partition_column="published_at",
            columns=["headline"],
        )
    )
    res = dg.materialize(
        [missing], partition_key="2026-11-01", resources=resources, raise_on_error=False
    )
    assert "uid" in res.get_step_failure_events()[0].step_failure_data.error.message
    assert fresh_sim.stats().get("received", 0) == 0


# -- secrets --------------------------------------------------------------------------------------


def test_a_planted_key_appears_in_no_log_metadata_exception_or_row(fresh_sim, tmp_path, caplog):
    secret = "sk-planted-" + "7f3a9c" * 6
    db = str(tmp_path / "secret.duckdb")
    create_demo_table(db, days=2, per_day=30)
    fresh_sim.configure(api_key=secret, fail_500=0.2)
    resources = {"llm": llm(fresh_sim, api_key=secret), "warehouse": DuckDBWarehouse(database=db)}
    with caplog.at_level(logging.DEBUG), dg.instance_for_test() as instance:
        ok = dg.materialize(
            [sentiment()], partition_key="2026-11-01", resources=resources, instance=instance
        )
        fresh_sim.configure(api_key="sk-other-key-entirely-1234")  # now the planted key is wrong
        bad = dg.materialize(
            [sentiment()],
            partition_key="2026-11-02",
            resources=resources,
            instance=instance,
            raise_on_error=False,
        )
        events = [str(e) for e in instance.all_logs(ok.run_id) + instance.all_logs(bad.run_id)]
        runs = [str(instance.get_run_by_id(r.run_id)) for r in (ok, bad)]
    haystack = "\n".join(
        [
            caplog.text,
            *events,
            *runs,
            repr(resources["llm"]),
            json.dumps(query(db, "SELECT * FROM news_sentiment"), default=str),
        ]
    )
    assert not bad.success and "authentication" in haystack
    for fragment in (secret, secret[3:20], secret[-12:]):
        assert fragment not in haystack


# -- injection ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    # "t\n": a pattern anchored with `$` would take it (`$` matches before a final newline).
    "name",
    ['t"; DROP TABLE x; --', "t`x", "t' OR 1=1", "t /* c */", "a;b", "t\n"],
)
def test_names_that_carry_sql_are_refused(name):
    with pytest.raises(BatchLLMError, match="Invalid"):
        sentiment(
            source=SourceTable(table=name, partition_column="published_at", columns=["headline"])
        )
    with pytest.raises(BatchLLMError, match="Invalid"):
        sentiment(source=SourceTable(table="t", partition_column=name, columns=["headline"]))
    with pytest.raises(BatchLLMError, match="Invalid"):
        sentiment(
            source=SourceTable(
                table="t", id_column=name, partition_column="p", columns=["headline"]
            )
        )


def test_templates_that_include_files_are_refused_at_definition_time():
    for template in (
        "{% include '/etc/passwd' %}",
        "{% import 'x' as y %}{{ headline }}",
        "{% extends 'base' %}",
    ):
        with pytest.raises(BatchLLMError, match="may not include"):
            sentiment(prompt=Prompt(template=template))


@pytest.mark.parametrize(
    "template",
    [
        "{{ headline.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{{ self.__init__.__globals__ }}",
    ],
)
def test_templates_cannot_reach_python_or_the_filesystem(fresh_sim, tmp_path, template):
    db = str(tmp_path / "tpl.duckdb")
    create_demo_table(db, days=1, per_day=3)
    a = sentiment(prompt=Prompt(template=template), max_failed_fraction=1.0)
    dg.materialize(
        [a],
        partition_key="2026-11-01",
        resources={"llm": llm(fresh_sim), "warehouse": DuckDBWarehouse(database=db)},
    )
    rows = query(db, "SELECT status, error_class FROM news_sentiment")
    assert rows and all(r == ("failed", "prompt_render") for r in rows)
    assert fresh_sim.stats().get("received", 0) == 0


def test_a_bigquery_project_id_is_the_only_place_a_hyphen_passes():
    from batch_llm_assets.warehouses.base import check_table

    assert check_table("my-project.research.news") == ("my-project", "research", "news")
    for bad in (
        "my-project.news",
        "proj.my-data.news",
        "my-project;x.a.b",
        "-project.a.b",
        "my-project\n.a.b",
    ):
        with pytest.raises(BatchLLMError, match="Invalid"):
            check_table(bad)
