"""LlmEmbeddingComponent: the embedding asset declared in YAML, loaded as a defs folder, checked
when it loads (errors name the attribute), materialised against the simulator and DuckDB."""

from __future__ import annotations

import dagster as dg
import pytest

from batch_llm_assets import DuckDBWarehouse, LLMResource

from .conftest import SIM_KEY
from .conftest import duckdb_query as query
from .test_component import error_text, load_attributes  # noqa: F401  (fixture)
from .test_embeddings import DAY, MODEL, PER_DAY, db  # noqa: F401  (fixture)

GOOD = {
    "name": "headline_embeddings",
    "source": {"table": "news_headlines", "partition_column": "published_at"},
    "text": "Headline: {{ headline }}",
    "output": "news_embeddings",
    "model": MODEL,
    "dimensions": 16,
    "partitions": {"type": "daily", "start_date": "2026-11-01", "end_date": "2026-11-04"},
    "schedule": {"hour_of_day": 3},
    "group_name": "embeddings",
}


def test_the_component_declares_the_asset_checks_job_and_schedule_and_runs(
    load_attributes,  # noqa: F811
    fresh_sim,
    db,  # noqa: F811
):
    defs = load_attributes(GOOD, "LlmEmbeddingComponent")
    key = dg.AssetKey("headline_embeddings")
    asset = next(a for a in defs.assets if isinstance(a, dg.AssetsDefinition) and key in a.keys)
    spec = asset.specs_by_key[key]
    assert spec.metadata["batch_llm/text_template"] == "Headline: {{ headline }}"  # literal
    assert spec.metadata["batch_llm/task"] == "embed" and spec.group_name == "embeddings"
    columns = {c.name: c.type for c in spec.metadata["dagster/column_schema"].columns}
    assert columns["embedding"] == "FLOAT[]" and columns["dimensions"] == "BIGINT"
    assert {c.name for c in asset.check_specs} == {"failed_fraction", "row_count_matches_input"}
    assert [s.name for s in defs.schedules] == ["headline_embeddings_latest_partition"]
    resources = {
        "llm": LLMResource(base_url=fresh_sim.url, api_key=SIM_KEY, model="gpt-4o-mini"),
        "warehouse": DuckDBWarehouse(database=db),
    }
    result = dg.materialize([asset], resources=resources, partition_key=DAY)
    assert result.success
    assert query(db, "SELECT count(*), min(len(embedding)) FROM news_embeddings") == [(PER_DAY, 16)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"text": "{{ body }}"}, "text: unknown column"),
        ({"dimensions": 0}, "dimensions: must be from 1"),
        ({"prompt": "x"}, "prompt"),
        ({"params": {"temperature": 0}}, "params"),
        (
            {"schedule": {"hour_of_day": 1}, "partitions": {"type": "static", "values": ["a"]}},
            "schedule",
        ),
    ],
)
def test_bad_attributes_fail_at_load_naming_them(load_attributes, change, message):  # noqa: F811
    attributes = GOOD | {"source": GOOD["source"] | {"columns": ["headline"]}} | change
    with pytest.raises(Exception) as info:
        load_attributes(attributes, "LlmEmbeddingComponent")
    assert message in error_text(info.value)
