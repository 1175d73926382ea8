"""Know the bill before launching (issue 30): the estimate of the demo asset against what its
runs then record, on the simulator and DuckDB (and BigQuery's emulator); the CLI's JSON line;
the UI's estimate job; hostile input. The simulator counts what was sent: the estimate, nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import dagster as dg
import pytest
from google.api_core.exceptions import NotFound

from batch_llm_assets import (
    DuckDBWarehouse,
    LLMResource,
    build_estimate_job,
    estimate_cost,
    select_partitions,
)
from batch_llm_assets.assets.estimate import EstimateInputError
from batch_llm_assets.assets.factory import build_asset_from_spec, spec_of
from batch_llm_assets.cli import main as cli_main
from batch_llm_assets.components import load_defs_folder
from batch_llm_assets.demo_data import create_demo_table

from .conftest import SIM_KEY
from .conftest import duckdb_query as query
from .test_bigquery import asset as bq_asset
from .test_bigquery import bq, bq_endpoint, dataset  # noqa: F401 (fixtures)
from .test_bigquery import materialize as bq_materialize
from .test_bigquery import warehouse as bq_warehouse

DAY1, DAY2, DAY3 = "2026-11-01", "2026-11-02", "2026-11-03"
JSON_KEYS = {"rows", "prompt_tokens", "output_tokens", "distinct_requests", "cost_usd"}
JSON_KEYS |= {"cost_usd_batch"}
STEP_TIMEOUT_S = 120  # one CLI process: loading Dagster and the demo definitions


def demo_asset() -> dg.AssetsDefinition:
    """The demo's asset as its YAML declares it (typed output, temperature 0, max_tokens 24)."""
    defs = load_defs_folder("batch_llm_assets.defs")
    key = dg.AssetKey("headline_sentiment")
    return next(a for a in defs.assets or [] if isinstance(a, dg.AssetsDefinition) and a.key == key)


def llm(sim) -> LLMResource:
    """The demo's LLM settings on the simulator: priced as the model it names."""
    return LLMResource(
        base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini", price_as_model="gpt-4o-mini"
    )


def estimate(asset, sim, db, **selection):
    keys = select_partitions(asset, **selection)
    return estimate_cost(
        asset, llm=llm(sim), warehouse=DuckDBWarehouse(database=db), partitions=keys
    )


def run(asset, sim, db, key) -> dict:
    """Materialize one partition; its metadata and what reached the simulator."""
    before = sim.stats().get("received", 0)
    result = dg.materialize(
        [asset],
        resources={"llm": llm(sim), "warehouse": DuckDBWarehouse(database=db)},
        partition_key=key,
        raise_on_error=False,
    )
    assert result.success
    mats = result.asset_materializations_for_node("headline_sentiment")
    md = {k: v.value for k, v in mats[-1].metadata.items()}
    md["sent"] = sim.stats()["received"] - before
    return md


def sent_by_estimates(sim, fn):
    """fn() and what reached the simulator meanwhile: requests and server probes."""
    before = {k: v for k, v in sim.stats().items() if isinstance(v, int)}
    value = fn()
    after = {k: v for k, v in sim.stats().items() if isinstance(v, int)}
    touched = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    return value, {k: n for k, n in touched.items() if k != "started_at"}


# -- against what the runs record ----------------------------------------------------------------


def test_the_estimate_comes_within_15_percent_of_the_cost_the_run_records(fresh_sim, tmp_path):
    db = str(tmp_path / "demo.duckdb")
    create_demo_table(db, days=3)
    asset = demo_asset()
    first, touched = sent_by_estimates(
        fresh_sim, lambda: estimate(asset, fresh_sim, db, partition=DAY1)
    )
    assert touched == {}  # nothing sent, not even a question to the server
    # Nothing stored yet: the demo's answer (a label and a score) has a size its schema bounds.
    assert first.output_basis.startswith("the typed answer's size")
    one = run(asset, fresh_sim, db, DAY1)
    # Requests and prompt tokens are the run's own.
    assert first.distinct_requests == one["sent"] == one["run/rows_sent"] < first.rows == 300
    assert abs(first.prompt_tokens - one["run/prompt_tokens"]) <= 0.02 * one["run/prompt_tokens"]
    recorded_first = one["run/cost_usd"]
    assert abs(first.cost_usd - recorded_first) <= 0.15 * recorded_first, (first, recorded_first)
    # Once the asset has answers, their mean: the next partition's estimate, then its run.
    second = estimate(asset, fresh_sim, db, partition=DAY2)
    two = run(asset, fresh_sim, db, DAY2)
    recorded = two["run/cost_usd"]
    [(table_cost,)] = query(
        db, f"SELECT sum(cost_usd) FROM news_sentiment WHERE partition_key = '{DAY2}'"
    )
    assert recorded == pytest.approx(table_cost, abs=1e-6) and recorded > 0
    assert abs(second.cost_usd - recorded) <= 0.15 * recorded, (second.cost_usd, recorded)
    assert second.output_basis.startswith("mean of the")
    assert second.distinct_requests == two["sent"] == two["run/rows_sent"]
    assert second.counts.reused == two["run/answers_reused"] > 0
    assert second.cost_usd_batch == pytest.approx(second.cost_usd / 2, rel=0.01)


def test_an_estimate_after_a_run_counts_the_answers_it_will_reuse(fresh_sim, tmp_path):
    db = str(tmp_path / "demo.duckdb")
    create_demo_table(db, days=3)
    asset = demo_asset()
    before = estimate(asset, fresh_sim, db, partition=DAY2)
    assert before.counts.reused == 0 and before.counts.shared > 0  # repeats within the day
    run(asset, fresh_sim, db, DAY1)
    after = estimate(asset, fresh_sim, db, partition=DAY2)
    assert after.counts.reused > 0 and after.distinct_requests < before.distinct_requests
    for est in (before, after):  # every row is counted once, by what its run would do
        c = est.counts
        assert c.done + c.shared + c.reused + c.unsendable + est.distinct_requests == 300
    assert after.cost_usd < before.cost_usd
    run(asset, fresh_sim, db, DAY2)
    done = estimate(asset, fresh_sim, db, partition=DAY2)
    assert (done.counts.done, done.distinct_requests, done.cost_usd) == (300, 0, 0.0)
    # A range: each request once over the range when answers are reused across partitions.
    span = estimate(asset, fresh_sim, db, start=DAY1, end=DAY3)
    third = estimate(asset, fresh_sim, db, partition=DAY3)
    assert span.rows == 900 and span.distinct_requests == third.distinct_requests
    assert span.sample is None


def test_a_long_range_is_sampled_and_says_so(fresh_sim, tmp_path):
    db = str(tmp_path / "demo.duckdb")
    create_demo_table(db, days=10)
    asset = demo_asset()
    keys = select_partitions(asset, start=DAY1, end="2026-11-10")
    full = estimate_cost(
        asset, llm=llm(fresh_sim), warehouse=DuckDBWarehouse(database=db), partitions=keys
    )
    part = estimate_cost(
        asset,
        llm=llm(fresh_sim),
        warehouse=DuckDBWarehouse(database=db),
        partitions=keys,
        sample_partitions=4,
    )
    assert full.sample is None and full.summary()["sampled"] is None
    assert part.summary()["sampled"] == {"partitions_read": 4, "partitions": 10, "rows_read": 1200}
    assert part.rows == full.rows == 3000
    assert "sampled: 4 of 10 partitions read" in part.table()
    # Fewer partitions share fewer requests across days: the sample errs high, not low.
    assert full.distinct_requests <= part.distinct_requests <= full.rows


# -- the CLI and the UI's job ----------------------------------------------------------------------


def cli(sim, db, *args: str, home=None) -> subprocess.CompletedProcess[str]:
    """`batch-llm-assets estimate` on the demo definitions, pointed at the simulator and `db`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "DAGSTER_HOME")}
    env |= {
        "BATCH_LLM_BASE_URL": sim.url,
        "BATCH_LLM_DUCKDB": db,
        "BATCH_LLM_PRICE_AS_MODEL": "gpt-4o-mini",  # as `make demo` sets it
    }
    if home is not None:
        env["DAGSTER_HOME"] = str(home)
    return subprocess.run(
        [sys.executable, "-m", "batch_llm_assets.cli", "estimate", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
    )


def test_the_cli_prints_a_table_and_last_one_json_line(fresh_sim, tmp_path):
    db = str(tmp_path / "demo.duckdb")
    create_demo_table(db, days=3)
    out = cli(fresh_sim, db, "headline_sentiment", "--partition", DAY2)
    assert out.returncode == 0, out.stderr[-2000:]
    *table, last = out.stdout.strip().splitlines()
    line = json.loads(last)
    assert set(line) >= JSON_KEYS and line["rows"] == 300
    assert line["cost_usd"] > 0 and line["cost_usd_batch"] > 0
    assert any(row.strip().startswith("distinct requests") for row in table)
    api = estimate(demo_asset(), fresh_sim, db, partition=DAY2)
    assert {k: line[k] for k in JSON_KEYS} == {k: api.summary()[k] for k in JSON_KEYS}
    assert fresh_sim.stats().get("received", 0) == 0
    # --missing asks DAGSTER_HOME's instance: nothing materialized there, so every partition.
    home = tmp_path / "home"
    home.mkdir()
    missing = cli(fresh_sim, db, "headline_sentiment", "--missing", home=home)
    assert missing.returncode == 0, missing.stderr[-2000:]
    assert json.loads(missing.stdout.splitlines()[-1])["rows"] == 900  # 3 days of 300 rows


def test_the_estimate_job_records_an_observation_of_the_asset(fresh_sim, tmp_path):
    db = str(tmp_path / "demo.duckdb")
    create_demo_table(db, days=3)
    asset = demo_asset()
    job = build_estimate_job(asset=asset)
    instance = dg.DagsterInstance.ephemeral()
    resources = {"llm": llm(fresh_sim), "warehouse": DuckDBWarehouse(database=db)}
    config = {"ops": {"headline_sentiment_estimate_op": {"config": {"partition": DAY2}}}}
    result = job.execute_in_process(run_config=config, instance=instance, resources=resources)
    assert result.success
    [event] = instance.fetch_observations(dg.AssetKey("headline_sentiment"), limit=5).records
    obs = event.asset_observation
    assert obs.partition == DAY2
    md = {k: v.value for k, v in obs.metadata.items()}
    api = estimate(asset, fresh_sim, db, partition=DAY2).summary()
    assert {k: md[f"estimate/{k}"] for k in JSON_KEYS} == {k: api[k] for k in JSON_KEYS}
    # Nothing set: every missing partition; a bad key fails the run with the reason.
    assert job.execute_in_process(instance=instance, resources=resources).success
    bad = {"ops": {"headline_sentiment_estimate_op": {"config": {"partition": "2031-01-01"}}}}
    failed = job.execute_in_process(
        run_config=bad, instance=instance, resources=resources, raise_on_error=False
    )
    [failure] = failed.get_step_failure_events()
    assert "has no partition '2031-01-01'" in failure.step_failure_data.error.message
    assert fresh_sim.stats().get("received", 0) == 0


# -- hostile input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["nope", "--partition", DAY1], "No asset 'nope'"),
        (["news_headlines", "--partition", DAY1], "was not built by build_llm_batch_asset"),
        (["headline_sentiment", "--partition", "2031-01-01"], "has no partition '2031-01-01'"),
        (["headline_sentiment", "--partition", "2026-11-01\udcff"], "'2026-11-01\\udcff'"),
        (["headline_sentiment", "--partition", "x" * 100_000], "has no partition 'xxxx"),
        (["headline_sentiment", "--partition", ""], "non-empty string"),
        (["headline_sentiment", "--from", DAY3, "--to", DAY1], "is inverted"),
        (["headline_sentiment", "--from", DAY1], "needs both its start and its end"),
        (["headline_sentiment", "--to", DAY1, "--partition", DAY2], "Choose one"),
        (["headline_sentiment"], "Choose one"),
        (["-m", "no_such_module", "headline_sentiment", "--missing"], "Could not import"),
        (["-m", "json", "headline_sentiment", "--missing"], "has no dg.Definitions"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_and_no_traceback(args, says, capsys):
    assert cli_main(["estimate", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    [line] = err.strip().splitlines()
    assert line.startswith("error: ") and says in line and len(line) < 400


def test_exclusive_flags_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["estimate", "headline_sentiment", "--partition", DAY1, "--missing"])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize(
    "selection",
    [
        {"partition": 20261101},
        {"partition": float("nan")},
        {"start": DAY1, "end": float("inf")},
        {"missing": "yes"},
        {"partition": DAY1, "missing": True},
    ],
)
def test_the_python_api_refuses_wrong_types(selection):
    with pytest.raises(EstimateInputError) as exc:
        select_partitions(demo_asset(), **selection)
    assert exc.value.description


@pytest.mark.parametrize("keys", [["2031-01-01"], [None], [float("nan")], [DAY1, 20261102]])
def test_estimate_cost_refuses_keys_that_are_not_partitions_before_reading(keys, tmp_path):
    db = str(tmp_path / "never-opened.duckdb")
    with pytest.raises(EstimateInputError, match="has no partition"):
        estimate_cost(
            demo_asset(),
            llm=LLMResource(base_url="http://127.0.0.1:9/v1"),
            warehouse=DuckDBWarehouse(database=db),
            partitions=keys,
        )
    assert not os.path.exists(db)


def test_an_asset_this_package_did_not_build_is_refused():
    @dg.asset
    def plain() -> None: ...

    with pytest.raises(EstimateInputError, match="was not built by"):
        select_partitions(plain)
    with pytest.raises(EstimateInputError, match="was not built by"):
        build_estimate_job(asset=plain)


# -- BigQuery ------------------------------------------------------------------------------------


@pytest.mark.bigquery
def test_on_bigquery_the_estimate_reads_and_creates_nothing_it_should_not(
    fresh_sim,
    bq_endpoint,  # noqa: F811
    bq,  # noqa: F811
    dataset,  # noqa: F811
):
    """The emulator's table: the output table does not exist before the first run (the estimate
    leaves it so); afterwards its answers give the mean. A local server is not priced."""
    a = bq_asset(dataset, params={"max_tokens": 5, "temperature": 0})
    plain = LLMResource(base_url=fresh_sim.url, api_key=SIM_KEY, model="gpt-4o-mini")

    def estimate_day(key):
        keys = select_partitions(a, partition=key)
        return estimate_cost(a, llm=plain, warehouse=bq_warehouse(bq_endpoint), partitions=keys)

    first = estimate_day(DAY1)
    with pytest.raises(NotFound):
        bq.get_table(f"{dataset}.news_sentiment")
    assert "max_tokens" in first.output_basis and first.output_tokens == 5 * first.distinct_requests
    assert (first.cost_usd, first.cost_usd_batch) == (None, None)
    assert "not priced" in first.table() and json.loads(first.json_line())["cost_usd"] is None
    assert bq_materialize(a, fresh_sim, bq_endpoint).success
    assert fresh_sim.stats()["received"] == first.distinct_requests
    second = estimate_day(DAY2)
    assert second.output_basis.startswith("mean of the")
    assert bq_materialize(a, fresh_sim, bq_endpoint, key=DAY2).success
    assert fresh_sim.stats()["received"] == first.distinct_requests + second.distinct_requests


def test_a_batch_mode_asset_is_estimated_with_one_line_per_distinct_request(fresh_sim, tmp_path):
    """The Batch API mode writes one line per distinct request to its batch file, as the live
    mode sends one (batch_pending.py): the two estimates agree."""
    db = str(tmp_path / "demo.duckdb")
    create_demo_table(db, days=1)
    live = demo_asset()
    spec = spec_of(live)
    batch = build_asset_from_spec(spec.model_copy(update={"mode": "batch"}))
    on_live = estimate(live, fresh_sim, db, partition=DAY1)
    on_batch = estimate(batch, fresh_sim, db, partition=DAY1)
    assert on_live.counts.shared > 0 and on_live.distinct_requests < 300
    assert on_batch.counts.shared == on_live.counts.shared
    assert on_batch.distinct_requests == on_live.distinct_requests
