"""LlmBatchComponent loaded from defs.yaml files, through the loader the code location uses."""

from __future__ import annotations

import importlib
import sys
import uuid
from datetime import date, timedelta
from pathlib import Path

import dagster as dg
import pydantic
import pytest
import yaml

from batch_llm_assets import DuckDBWarehouse, LLMResource, Prompt, SourceTable
from batch_llm_assets.assets import build_llm_batch_asset
from batch_llm_assets.components import LlmBatchComponent, LlmBatchConfigError, load_defs_folder
from batch_llm_assets.demo_data import DEMO_DAYS, DEMO_START, create_demo_table

from .conftest import SIM_KEY

FIXTURES = "tests.fixtures"
WEBHOOK = "https://hooks.example.invalid/services/T000/B000/secret-token"
CHECKS = {"failed_fraction", "row_count_matches_input"}


@pytest.fixture
def env(monkeypatch):
    monkeypatch.setenv("BATCH_LLM_TEST_WEBHOOK", WEBHOOK)
    monkeypatch.setenv("BATCH_LLM_TEST_GROUP", "research")


@pytest.fixture
def ok_defs(env) -> dg.Definitions:
    return load_defs_folder(f"{FIXTURES}.component_ok")


def error_text(exc: BaseException | None) -> str:
    """The error behind a failed load: the component's own (LlmBatchConfigError, "path: why"),
    else the YAML schema's (a pydantic error Dagster reports as "attributes.path at file:line")."""
    first = exc
    while exc is not None:
        if isinstance(exc, LlmBatchConfigError):
            return exc.description
        if isinstance(exc, pydantic.ValidationError):
            return str(exc)
        exc = exc.__cause__ or exc.__context__
    raise AssertionError(f"no LlmBatchConfigError nor ValidationError behind {first!r}")


def assert_names(text: str, message: str | tuple[str, ...]) -> None:
    """Our errors start with 'path: why'; the YAML schema's carry the path and the reason."""
    if isinstance(message, str):
        assert text.startswith(message), text
    else:
        assert all(fragment in text for fragment in message), text


def load_error(module: str) -> str:
    """Load a defs folder that must fail; the error text naming the attribute."""
    with pytest.raises(Exception) as info:
        load_defs_folder(module)
    return error_text(info.value)


def by_key(defs: dg.Definitions) -> dict[dg.AssetKey, dg.AssetsDefinition]:
    return {a.key: a for a in defs.assets or [] if isinstance(a, dg.AssetsDefinition)}


def with_resources(defs: dg.Definitions, **kw) -> dg.Definitions:
    return dg.Definitions.merge(
        defs,
        dg.Definitions(
            resources={"llm": LLMResource(**kw), "warehouse": DuckDBWarehouse(database=":memory:")}
        ),
    )


# --- a valid folder ---------------------------------------------------------------------------


def test_ok_fixture_yields_assets_checks_jobs_schedule_and_sensors(ok_defs):
    headline, incoming = (
        dg.AssetKey("headline_sentiment"),
        dg.AssetKey(["research", "incoming_sentiment"]),
    )
    assert set(by_key(ok_defs)) == {headline, incoming}
    check_keys = {key for a in by_key(ok_defs).values() for key in a.check_keys}
    assert check_keys == {dg.AssetCheckKey(headline, name) for name in CHECKS}  # incoming: off
    assert {j.name for j in ok_defs.jobs or []} == {
        "headline_sentiment_job",
        "headline_sentiment_estimate",  # the cost estimate, from the UI (assets/estimate_job.py)
        "incoming_sentiment_job",
        "research__incoming_sentiment_estimate",
    }

    (schedule,) = ok_defs.schedules or []
    assert schedule.name == "headline_sentiment_latest_partition"
    assert schedule.job_name == "headline_sentiment_job"
    assert schedule.cron_schedule == "30 2 * * *"
    assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING

    sensors = {s.name: s for s in ok_defs.sensors or []}
    assert set(sensors) == {
        "incoming_sentiment_new_input_tables",
        "headline_sentiment_notify_success",
        "headline_sentiment_notify_failure",
    }
    assert all(s.default_status == dg.DefaultSensorStatus.STOPPED for s in sensors.values())
    # The whole code location resolves once resources are added.
    repo = with_resources(ok_defs).get_repository_def()
    assert repo.get_job("headline_sentiment_job").partitions_def is not None


def test_attributes_reach_the_asset(ok_defs):
    assets = by_key(ok_defs)
    a = assets[dg.AssetKey("headline_sentiment")]
    md = a.specs_by_key[a.key].metadata
    # The prompt is taken literally: the loader's own templating never touches it.
    assert md["batch_llm/prompt_template"] == (
        "Headline: {{ headline }}\nAnswer with one of: positive, negative, neutral"
    )
    assert md["batch_llm/model"] == "gpt-4o-mini"
    assert md["batch_llm/output_table"] == "news_sentiment"
    assert a.group_names_by_key[a.key] == "research"  # "{{ env.BATCH_LLM_TEST_GROUP }}"
    assert a.tags_by_key[a.key]["team"] == "research"
    assert a.partitions_def == dg.DailyPartitionsDefinition(
        start_date="2026-11-01", end_date="2026-11-04"
    )
    assert {"llm", "warehouse"} <= a.required_resource_keys

    b = assets[dg.AssetKey(["research", "incoming_sentiment"])]
    assert b.partitions_def == dg.DynamicPartitionsDefinition(name="input_tables")
    md = b.specs_by_key[b.key].metadata
    assert md["batch_llm/table_per_partition"] is True
    assert md["batch_llm/prompt_template"] == "{{ headline }} Answer with one of: up, down"


def test_the_webhook_url_is_read_from_the_environment_and_kept_out_of_the_component(ok_defs):
    asset = by_key(ok_defs)[dg.AssetKey("headline_sentiment")]
    component = asset.specs_by_key[asset.key].metadata["dagster/component_origin"].instance
    assert isinstance(component, LlmBatchComponent)
    assert component.notifications.webhook_url_env == "BATCH_LLM_TEST_WEBHOOK"
    assert "secret-token" not in component.model_dump_json()


def test_yaml_and_python_build_the_same_asset(ok_defs):
    yaml_asset = by_key(ok_defs)[dg.AssetKey("headline_sentiment")]
    py_asset = build_llm_batch_asset(
        name="headline_sentiment",
        source=SourceTable(
            table="news_headlines",
            id_column="id",
            partition_column="published_at",
            columns=["headline"],
        ),
        prompt=Prompt(
            system="You are a financial news analyst. Reply with a single word.",
            template="Headline: {{ headline }}\nAnswer with one of: positive, negative, neutral",
        ),
        output="news_sentiment",
        model="gpt-4o-mini",
        params={"temperature": 0, "max_tokens": 5},
        partitions_def=dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04"),
        max_failed_fraction=0.1,
        chunk_rows=40,
        group_name="research",
        tags={"team": "research"},
    )
    yaml_spec, py_spec = (
        yaml_asset.specs_by_key[yaml_asset.key],
        py_asset.specs_by_key[py_asset.key],
    )
    # The YAML loader adds only where the asset was declared (code references, component).
    added = {"dagster/code_references", "dagster/component_origin"}
    assert {k: v for k, v in yaml_spec.metadata.items() if k not in added} == py_spec.metadata
    for attr in ("description", "group_name", "tags", "kinds", "owners", "deps", "partitions_def"):
        assert getattr(yaml_spec, attr) == getattr(py_spec, attr), attr
    assert yaml_asset.required_resource_keys == py_asset.required_resource_keys


def test_the_demo_folder_declares_the_former_python_demo_asset():
    demo = load_defs_folder("batch_llm_assets.defs")
    assets = by_key(demo)
    assert set(assets) == {dg.AssetKey("headline_sentiment"), dg.AssetKey("headline_embeddings")}
    asset = assets[dg.AssetKey("headline_sentiment")]
    end = (date.fromisoformat(DEMO_START) + timedelta(days=DEMO_DAYS)).isoformat()
    assert asset.partitions_def == dg.DailyPartitionsDefinition(start_date=DEMO_START, end_date=end)
    md = asset.specs_by_key[asset.key].metadata
    assert md["batch_llm/source_table"] == "news_headlines"
    assert md["batch_llm/output_table"] == "news_sentiment"
    assert asset.group_names_by_key[asset.key] == "demo"
    # The two partition checks, and one NULL-fraction check per typed field (label, confidence).
    assert {k.name for k in asset.check_keys} == CHECKS | {
        "label_null_fraction",
        "confidence_null_fraction",
    }
    assert [s.job_name for s in demo.schedules or []] == ["headline_sentiment_job"]

    from batch_llm_assets import definitions

    assert definitions.headline_sentiment.key == asset.key
    assert definitions.headline_sentiment_job.name == "headline_sentiment_job"
    assert definitions.defs.get_repository_def().get_job("headline_sentiment_job")
    assert set(definitions.defs.resources or {}) == {"llm", "warehouse"}


def test_a_yaml_asset_and_its_checks_run(ok_defs, fresh_sim, tmp_path):
    db = str(tmp_path / "w.duckdb")
    create_demo_table(db, days=3, per_day=60)
    asset = by_key(ok_defs)[dg.AssetKey("headline_sentiment")]
    result = dg.materialize(
        [asset],
        partition_key="2026-11-02",
        resources={
            "llm": LLMResource(base_url=fresh_sim.url, api_key=SIM_KEY, model="gpt-4o-mini"),
            "warehouse": DuckDBWarehouse(database=db),
        },
    )
    assert result.success
    md = result.asset_materializations_for_node("headline_sentiment")[0].metadata
    assert md["partition/rows_ok"].value == 60
    evaluations = result.get_asset_check_evaluations()
    assert {e.check_name for e in evaluations} == CHECKS
    assert all(e.passed for e in evaluations)


def test_every_attribute_is_described():
    schema = LlmBatchComponent.model().model_json_schema()
    models = [schema, *schema.get("$defs", {}).values()]
    missing = [
        f"{m.get('title')}.{name}"
        for m in models
        for name, prop in m.get("properties", {}).items()
        if not prop.get("description")
    ]
    assert not missing
    assert "model" in schema["properties"]  # the YAML name of the llm_model attribute


# --- invalid folders: each fails at load, naming the attribute ---------------------------------


@pytest.mark.parametrize(
    "fixture, message",
    [
        ("component_bad_unknown_column", "prompt.template: unknown column 'body'"),
        ("component_bad_missing_table", ("attributes.source", ".table", "Field required")),
        ("component_bad_params", ("attributes.params", "defs.yaml:7", "should be an object")),
        ("component_bad_identifier", "source.id_column: Invalid id column name"),
    ],
)
def test_invalid_fixtures_fail_at_load_naming_the_attribute(fixture, message):
    assert_names(load_error(f"{FIXTURES}.{fixture}"), message)


GOOD = {
    "name": "headline_sentiment",
    "source": {
        "table": "news_headlines",
        "partition_column": "published_at",
        "columns": ["headline"],
    },
    "prompt": {"template": "Headline: {{ headline }}"},
    "output": "news_sentiment",
}


@pytest.fixture
def load_attributes(tmp_path, monkeypatch):
    """Write a defs folder with one component of these attributes, then load it."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def load(attributes: dict, kind: str = "LlmBatchComponent") -> dg.Definitions:
        package = f"defs_{uuid.uuid4().hex[:8]}"
        folder = Path(tmp_path, package, "component")
        folder.mkdir(parents=True)
        doc = {"type": f"batch_llm_assets.components.{kind}", "attributes": attributes}
        (folder / "defs.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        importlib.invalidate_caches()
        try:
            return load_defs_folder(package)
        finally:
            sys.modules.pop(package, None)

    return load


@pytest.mark.parametrize(
    "change, message",
    [
        ({"max_failed_fraction": -0.1}, "max_failed_fraction: must be within [0, 1], got -0.1"),
        (
            {"max_failed_fraction": "a lot"},
            ("max_failed_fraction", "Input should be a valid number"),
        ),
        ({"warn_failed_fraction": 2}, "warn_failed_fraction: must be within [0, 1], got 2"),
        ({"params": {"n": 3}}, "params.n: is 3"),
        ({"chunk_rows": 0}, "chunk_rows: must be >= 1"),
        ({"reuse_answers": "sometimes"}, ("reuse_answers", "Input should be a valid boolean")),
        ({"params": "temperature=0"}, ("params", "Input should be a valid dictionary")),
        ({"params": {"temperature": "hot"}}, "params.temperature: must be a number"),
        ({"params": {"temperature": 7}}, "params.temperature: must be within [0, 2], got 7"),
        ({"params": {"max_tokens": 0}}, "params.max_tokens: must be >= 1"),
        ({"params": {"model": "x"}}, "params.model: not allowed"),
        ({"name": "headline-sentiment"}, "name: Invalid asset name"),
        ({"output": "news;sentiment"}, "output: Invalid table name"),
        ({"source": {**GOOD["source"], "table": 'news"headlines'}}, "source.table: Invalid"),
        ({"source": {**GOOD["source"], "columns": ["head line"]}}, "source.columns[0]: Invalid"),
        (
            {"source": {"table": "news_headlines", "columns": ["headline"]}},
            "source.partition_column: required",
        ),
        (
            {"prompt": {"template": "{{ headline }}", "system": "As {{ persona }}"}},
            "prompt.system: unknown column 'persona'",
        ),
        ({"prompt": {"template": "{{ headline "}}, "prompt.template: Malformed prompt template"),
        (
            {"prompt": {"template": "{{ headline }}", "sytem": "x"}},
            ("attributes.prompt", ".sytem", "Extra inputs are not permitted"),
        ),
        ({"outptu": "x"}, ("attributes.outptu", "Extra inputs are not permitted")),
        ({"partitions": {"type": "daily"}}, "partitions.start_date: required for type 'daily'"),
        ({"partitions": {"type": "yearly"}}, ("attributes.partitions", ".type", "Input should be")),
        (
            {"partitions": {"type": "daily", "start_date": "2026-11-01", "end_date": "soon"}},
            "partitions.end_date:",
        ),
        (
            {"partitions": {"type": "daily", "start_date": "2026-11-05", "end_date": "2026-11-01"}},
            "partitions.end_date: must be after start_date",
        ),
        ({"partitions": {"type": "static"}}, "partitions.values: required"),
        (
            {"partitions": {"type": "static", "values": ["a"]}, "schedule": {}},
            "schedule: needs time partitions",
        ),
        ({"schedule": {"hour_of_day": 24}}, "schedule.hour_of_day: must be 0-23"),
        (
            {"new_tables_sensor": {"dataset": "incoming", "table_pattern": ".*"}},
            "new_tables_sensor: needs partitions.type 'dynamic'",
        ),
        (
            {
                "partitions": {"type": "dynamic"},
                "new_tables_sensor": {"dataset": "incoming", "table_pattern": "("},
            },
            "new_tables_sensor.table_pattern: not a valid regular expression",
        ),
        (
            {"notifications": {"webhook_url_env": "https://hooks.example.invalid/x"}},
            "notifications.webhook_url_env: must be the name of an environment variable",
        ),
        (
            {"notifications": {"webhook_url_env": "BATCH_LLM_TEST_UNSET_WEBHOOK"}},
            "notifications.webhook_url_env: environment variable 'BATCH_LLM_TEST_UNSET_WEBHOOK' "
            "is not set",
        ),
    ],
)
def test_invalid_attributes_fail_at_load_naming_the_attribute(load_attributes, change, message):
    with pytest.raises(Exception) as info:
        load_attributes(GOOD | change)
    assert_names(error_text(info.value), message)


def test_good_attributes_load_and_default_to_daily_partitions(load_attributes):
    defs = load_attributes(GOOD)
    (asset,) = by_key(defs).values()
    assert asset.partitions_def == dg.DailyPartitionsDefinition(start_date="2019-01-01")
    assert {k.name for k in asset.check_keys} == CHECKS
    assert not defs.schedules and not defs.sensors
    assert [j.name for j in defs.jobs or []] == [
        "headline_sentiment_job",
        "headline_sentiment_estimate",
    ]
