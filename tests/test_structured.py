"""Typed outputs in runs: validated answers -> typed columns (DuckDB, the BigQuery emulator),
with repair, refusals, a provider that rejects the form, and schema evolution. The output_schema
itself and the request forms per provider are in test_structured_schema_and_forms.py.

Everything runs against the simulator over HTTP, which answers schema requests with JSON
generated from the schema (and, by settings, invalid, truncated or refused answers).
"""

from __future__ import annotations

import json
from typing import Literal

import dagster as dg
import duckdb
import pytest
from pydantic import BaseModel, Field

from batch_llm_assets import DuckDBWarehouse, LLMResource, Prompt, SourceTable
from batch_llm_assets import build_llm_batch_asset as build
from batch_llm_assets.assets.structured import parse_output_schema
from batch_llm_assets.components.loader import load_defs_folder
from batch_llm_assets.demo_data import create_demo_table
from batch_llm_assets.resources.bigquery_warehouse import BigQueryWarehouse

from .conftest import SIM_KEY, duckdb_query
from .test_bigquery import PROJECT, bq, bq_endpoint, dataset, query  # noqa: F401 (fixtures)

DAYS = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04")
DAY = "2026-11-02"
PER_DAY = 12
PROMPT = Prompt(system="You are a financial analyst.", template="Headline: {{ headline }}")
SENTIMENT = {
    "label": {"type": "enum", "values": ["positive", "negative", "neutral"]},
    "confidence": {"type": "number", "minimum": 0, "maximum": 1, "description": "0 to 1"},
}


class Analysis(BaseModel):
    """Every supported kind of field, declared the Python way."""

    label: Literal["positive", "negative", "neutral"] = Field(description="the sentiment")
    confidence: float = Field(ge=0, le=1)
    mentions: int = Field(ge=0, le=5)
    about_rates: bool
    tickers: list[str]
    details: dict
    sector: Literal["banks", "energy"] | None = Field(description="null when none applies")


class ProfiledLLM(LLMResource):
    """LLMResource with the provider setting the engine's profiles add (test-only stand-in:
    the simulator's URL would otherwise be read as a generic server)."""

    provider: str | None = Field(default=None, description="Provider profile name.")


@pytest.fixture
def ssim(fresh_sim):
    """The simulator with its structured-output faults off (and off again afterwards)."""
    off = dict(invalid_json=0.0, truncated_json=0.0, refuse=0.0, reject_json_schema=False)
    fresh_sim.configure(**off)
    yield fresh_sim
    fresh_sim.configure(**off)


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "w.duckdb")
    create_demo_table(path, days=3, per_day=PER_DAY)
    return path


def asset(schema=SENTIMENT, **kw):
    settings = dict(
        name="sentiment",
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=PROMPT,
        output="news_sentiment",
        params={"max_tokens": 80},
        partitions_def=DAYS,
        output_schema=schema,
    )
    return build(**(settings | kw))


def run(a, sim, warehouse, *, provider=None, **llm):
    resource = ProfiledLLM(
        base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini", provider=provider, **llm
    )
    result = dg.materialize(
        [a],
        resources={"llm": resource, "warehouse": warehouse},
        partition_key=DAY,
        raise_on_error=False,
    )
    mats = result.asset_materializations_for_node("sentiment")
    return result, ({k: v.value for k, v in mats[-1].metadata.items()} if mats else {})


def rows(db, columns="*"):
    return duckdb_query(db, f"SELECT {columns} FROM news_sentiment ORDER BY id")


# -- typed columns ------------------------------------------------------------------------------
def test_typed_round_trip_on_duckdb(ssim, db):
    a = asset(Analysis)
    result, md = run(a, ssim, DuckDBWarehouse(database=db))
    assert result.success
    assert md["run/rows_ok"] == PER_DAY
    types = dict(
        duckdb_query(
            db,
            "SELECT column_name, data_type FROM information_schema.columns "
            "WHERE table_name = 'news_sentiment'",
        )
    )
    assert {c: types[c] for c in parse_output_schema(Analysis).names} == {
        "label": "VARCHAR",
        "confidence": "DOUBLE",
        "mentions": "BIGINT",
        "about_rates": "BOOLEAN",
        "tickers": "VARCHAR[]",
        "details": "JSON",
        "sector": "VARCHAR",
    }
    for label, conf, mentions, rates, tickers, details, response in rows(
        db, "label, confidence, mentions, about_rates, tickers, details, response"
    ):
        raw = json.loads(response)  # `response` keeps the raw answer the columns came from
        assert (label, conf, mentions, rates, tickers) == (
            raw["label"],
            raw["confidence"],
            raw["mentions"],
            raw["about_rates"],
            raw["tickers"],
        )
        assert json.loads(details) == raw["details"]
        assert 0 <= conf <= 1 and label in ("positive", "negative", "neutral")
    assert md["batch_llm/null_fraction/label"] == 0.0
    # The column schema lists the typed columns with their descriptions.
    columns = {c.name: c for c in a.specs_by_key[a.key].metadata["dagster/column_schema"].columns}
    assert columns["label"].description == "the sentiment" and columns["tickers"].type == (
        "list<string>"
    )
    # The same schema again: every row is done, nothing is sent.
    answered = ssim.stats()["answered"]
    _, again = run(a, ssim, DuckDBWarehouse(database=db))
    assert again["run/rows_skipped"] == PER_DAY and ssim.stats()["answered"] == answered


@pytest.mark.bigquery
def test_typed_round_trip_on_the_bigquery_emulator(ssim, bq_endpoint, bq, dataset):  # noqa: F811
    a = asset(
        Analysis,
        source=SourceTable(
            table=f"{dataset}.news_headlines", partition_column="published_at", columns=["headline"]
        ),
        output=f"{dataset}.news_sentiment",
    )
    warehouse = BigQueryWarehouse(project=PROJECT, api_endpoint=bq_endpoint)
    result, md = run(a, ssim, warehouse)
    assert result.success and md["run/rows_ok"] > 0
    table = bq.get_table(f"{dataset}.news_sentiment")
    kinds = {f.name: (f.field_type, f.mode) for f in table.schema}
    assert kinds["about_rates"] == ("BOOLEAN", "NULLABLE")
    assert kinds["tickers"] == ("STRING", "REPEATED")
    assert kinds["mentions"][0] == "INTEGER" and kinds["details"][0] == "STRING"
    got = query(
        bq,
        f"SELECT label, confidence, mentions, about_rates, tickers, details, response "
        f"FROM `{dataset}`.`news_sentiment` WHERE status = 'ok'",
    )
    assert len(got) == md["run/rows_ok"]
    for label, conf, mentions, rates, tickers, details, response in got:
        raw = json.loads(response)
        assert [label, conf, mentions, rates, list(tickers), json.loads(details)] == [
            raw[k] for k in ("label", "confidence", "mentions", "about_rates", "tickers", "details")
        ]
    # Rerun: the same identity, nothing sent; the table's types are accepted as they are.
    answered = ssim.stats()["answered"]
    result, again = run(a, ssim, warehouse)
    assert result.success and again["run/rows_skipped"] == md["run/rows_ok"]
    assert ssim.stats()["answered"] == answered


# -- invalid answers, repair, refusals ------------------------------------------------------------
# Rows failing the same way one after another trip the breaker (tests/test_typed_small_model.py);
# the tests of single rows' outcomes below set it out of reach.
ROWS_ALIKE_OK = PER_DAY + 1


def test_invalid_json_is_repaired_or_fails_invalid_output(ssim, db):
    ssim.configure(invalid_json=0.5)
    ssim.reset()
    result, md = run(
        asset(max_failed_fraction=1.0, warn_failed_fraction=1.0),
        ssim,
        DuckDBWarehouse(database=db),
        breaker_threshold=ROWS_ALIKE_OK,
    )
    assert result.success
    got = rows(db, "status, error_class, error, attempts, label, response, completion_tokens")
    repaired = [r for r in got if r[0] == "ok" and r[3] == 2]
    failed = [r for r in got if r[0] == "failed"]
    assert repaired, "some first answers were invalid JSON and their repair was valid"
    assert all(r[4] is not None for r in got if r[0] == "ok")
    for _, error_class, error, attempts, label, response, _ in failed:
        assert (error_class, attempts, label) == ("invalid_output", 2, None)
        assert "not valid JSON" in error and response  # the raw answer is kept
    # Every request's tokens are counted: the first answers' and the repairs'.
    stats = ssim.stats()
    assert stats["answered"] == sum(r[3] for r in got)
    assert sum(r[6] for r in got) == stats["completion_tokens"] == md["run/completion_tokens"]
    assert md["batch_llm/null_fraction/label"] == pytest.approx(len(failed) / len(got))
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert {"label_null_fraction", "confidence_null_fraction"} <= set(checks)
    assert checks["label_null_fraction"].metadata["null_fraction"].value == pytest.approx(
        len(failed) / len(got)
    )
    assert checks["label_null_fraction"].passed  # warn_failed_fraction is 1.0 here


def test_without_repair_an_invalid_answer_fails_at_once(ssim, db):
    ssim.configure(invalid_json=1.0)
    a = asset(repair_attempts=0, max_failed_fraction=1.0)
    result, md = run(a, ssim, DuckDBWarehouse(database=db), breaker_threshold=ROWS_ALIKE_OK)
    assert result.success and md["run/rows_failed"] == PER_DAY
    assert set(rows(db, "status, error_class, attempts")) == {("failed", "invalid_output", 1)}
    assert md["batch_llm/null_fraction/confidence"] == 1.0


def test_a_truncated_answer_is_invalid_output(ssim, db):
    ssim.configure(truncated_json=1.0)
    run(
        asset(repair_attempts=1),
        ssim,
        DuckDBWarehouse(database=db),
        breaker_threshold=ROWS_ALIKE_OK,
    )
    got = rows(db, "status, error_class, error, attempts")
    assert {(s, c, n) for s, c, _, n in got} == {("failed", "invalid_output", 2)}
    assert all(e.startswith("answer truncated at max_tokens") for _, _, e, _ in got)


def test_a_refusal_fails_refusal_and_is_not_repaired(ssim, db):
    ssim.configure(refuse=1.0)
    run(asset(), ssim, DuckDBWarehouse(database=db))
    got = rows(db, "status, error_class, error, attempts, label")
    assert {(s, c, n, lbl) for s, c, _, n, lbl in got} == {("failed", "refusal", 1, None)}
    assert all("can't help" in e for _, _, e, _, _ in got)


# -- a provider that rejects the form -------------------------------------------------------------
def test_a_provider_rejecting_json_schema_stops_the_run_not_each_row(ssim, db):
    ssim.configure(reject_json_schema=True)
    wh = DuckDBWarehouse(database=db)
    result, md = run(asset(), ssim, wh, provider="openai", max_concurrency=2, max_attempts=6)
    assert not result.success
    # Not retried per row, and the breaker stops sending after 3 in a row (2 in flight).
    assert ssim.stats()["rejected_json_schema"] <= 3 + 1
    got = rows(db, "error_class, attempts")
    assert {a for c, a in got if c == "structured_output_unsupported"} == {1}
    assert {c for c, _ in got} == {"structured_output_unsupported", "aborted"}
    errors = [e for (e,) in rows(db, "error") if "rejected the structured-output" in e]
    assert errors and "json_schema" in errors[0]
    # The form that server takes (llama.cpp's json_object + schema) works on the same server.
    result, md = run(asset(), ssim, DuckDBWarehouse(database=db), provider="llamacpp")
    assert result.success and md["run/rows_ok"] == PER_DAY


# -- schema evolution ---------------------------------------------------------------------------
def test_a_new_field_adds_a_nullable_column_and_reruns_the_rows(ssim, db):
    result, _ = run(asset({"label": SENTIMENT["label"]}), ssim, DuckDBWarehouse(database=db))
    assert result.success
    hashes = dict(rows(db, "id, request_hash"))
    result, md = run(asset(SENTIMENT), ssim, DuckDBWarehouse(database=db))
    assert result.success
    assert (
        md["run/rows_skipped"] == 0 and md["run/rows_ok"] == PER_DAY
    )  # the schema is in the identity
    after = rows(db, "id, request_hash, confidence")
    assert all(h != hashes[i] and c is not None for i, h, c in after)
    # Rows of another partition, written before the column existed, read NULL in it.
    con = duckdb.connect(db)
    try:
        con.execute("INSERT INTO news_sentiment (id, partition_key) VALUES (-1, 'old')")
        assert con.execute("SELECT confidence FROM news_sentiment WHERE id = -1").fetchone() == (
            None,
        )
    finally:
        con.close()


def test_a_changed_field_type_is_refused_naming_the_field_and_both_types(ssim, db):
    assert run(asset(SENTIMENT), ssim, DuckDBWarehouse(database=db))[0].success
    changed = {**SENTIMENT, "confidence": "string"}
    result, _ = run(asset(changed), ssim, DuckDBWarehouse(database=db))
    assert not result.success
    message = result.get_step_failure_events()[0].step_failure_data.error.message
    assert "confidence is DOUBLE, expected VARCHAR" in message


# -- the demo ---------------------------------------------------------------------------------------
def test_the_demo_asset_declares_label_and_confidence(ssim, db):
    (demo,) = [
        a
        for a in load_defs_folder("batch_llm_assets.defs").assets or []
        if isinstance(a, dg.AssetsDefinition) and a.key == dg.AssetKey("headline_sentiment")
    ]
    columns = {
        c.name: c for c in demo.specs_by_key[demo.key].metadata["dagster/column_schema"].columns
    }
    assert (columns["label"].type, columns["confidence"].type) == ("string", "float")
    assert columns["confidence"].description
    result = dg.materialize(
        [demo],
        partition_key=DAY,
        resources={
            "llm": LLMResource(base_url=ssim.url, api_key=SIM_KEY, model="gpt-4o-mini"),
            "warehouse": DuckDBWarehouse(database=db),
        },
    )
    assert result.success
    got = duckdb_query(
        db,
        "SELECT label, count(*), min(confidence), max(confidence) FROM news_sentiment GROUP BY 1",
    )
    assert {g[0] for g in got} <= {"positive", "negative", "neutral"}
    assert sum(g[1] for g in got) == PER_DAY
    assert all(0 <= g[2] <= g[3] <= 1 for g in got)


@pytest.mark.bigquery
def test_schema_evolution_on_the_bigquery_emulator(ssim, bq_endpoint, bq, dataset):  # noqa: F811
    def bq_asset(schema):
        return asset(
            schema,
            source=SourceTable(
                table=f"{dataset}.news_headlines",
                partition_column="published_at",
                columns=["headline"],
            ),
            output=f"{dataset}.news_sentiment",
        )

    warehouse = BigQueryWarehouse(project=PROJECT, api_endpoint=bq_endpoint)
    assert run(bq_asset({"label": SENTIMENT["label"]}), ssim, warehouse)[0].success
    # Two new fields at once: two new nullable columns, and the rows run again.
    grown = {**SENTIMENT, "tickers": {"type": "list", "items": "string"}}
    result, md = run(bq_asset(grown), ssim, warehouse)
    assert result.success and md["run/rows_skipped"] == 0
    got = query(
        bq, f"SELECT confidence, tickers FROM `{dataset}`.`news_sentiment` WHERE status = 'ok'"
    )
    assert got and all(isinstance(c, float) and t and isinstance(t[0], str) for c, t in got)
    # A changed type is refused, naming the field and both types.
    result, _ = run(bq_asset({**grown, "confidence": "integer"}), ssim, warehouse)
    message = result.get_step_failure_events()[0].step_failure_data.error.message
    assert "confidence is FLOAT64, expected INT64" in message
