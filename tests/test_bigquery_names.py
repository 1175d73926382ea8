"""Names on BigQuery: a missing dataset, table or column is a clear error before anything is
sent, column names match ignoring case as BigQuery's do, identifiers that carry SQL are refused
by the asset factory and by the session itself, and a table name needs a dataset and a valid
(possibly hyphenated) project id."""

from __future__ import annotations

import pytest

from batch_llm_assets import Prompt, SourceTable
from batch_llm_assets.assets.schema import output_table
from batch_llm_assets.engine.errors import BatchLLMError
from batch_llm_assets.warehouses.base import SourceRef
from batch_llm_assets.warehouses.bigquery_names import quote_table, table_parts

from .test_bigquery import (  # noqa: F401  (fixtures)
    PROMPT,
    asset,
    bq,
    bq_endpoint,
    dataset,
    day_ids,
    failure_message,
    materialize,
    metadata,
    warehouse,
)

pytestmark = pytest.mark.bigquery


def test_missing_dataset_table_or_column_is_a_clear_error(fresh_sim, bq_endpoint, dataset):  # noqa: F811
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


def test_column_names_are_matched_ignoring_case_as_bigquery_does(fresh_sim, bq_endpoint, dataset):  # noqa: F811
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
def test_unsafe_identifiers_are_refused(bad, bq_endpoint, bq, dataset):  # noqa: F811
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
