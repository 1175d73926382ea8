"""Batch mode (issue 13): the Batch API path against the simulator's /v1/files and /v1/batches,
with DuckDB files and real `dagster asset materialize` subprocesses; counted at the simulator."""

from __future__ import annotations

import json
import urllib.request

import dagster as dg
import pytest

from batch_llm_assets import (
    DuckDBWarehouse,
    LLMResource,
    Prompt,
    SourceTable,
    build_llm_batch_asset,
)
from batch_llm_assets.assets.batch_mode import BatchSettings, state_table_for
from batch_llm_assets.demo_data import create_demo_table

from .conftest import SIM_KEY
from .conftest import duckdb_query as query

DAYS = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04")
PROMPT = Prompt(
    template="Headline: {{ headline }}\nAnswer with one of: positive, negative, neutral"
)
PER_DAY = 30
STATE = state_table_for("news_sentiment")


def asset(**settings):
    return build_llm_batch_asset(
        name="sentiment",
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=PROMPT,
        output="news_sentiment",
        params={"max_tokens": 5},
        partitions_def=DAYS,
        mode="batch",
        batch=BatchSettings(**({"poll_first_s": 0.2, "poll_max_s": 0.5} | settings)),
    )


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "w.duckdb")
    create_demo_table(path, days=3, per_day=PER_DAY)
    return path


@pytest.fixture
def bsim(fresh_sim):
    """The shared simulator with default batch settings (a batch takes 0.5 s)."""
    batch_config(
        fresh_sim,
        completion_s=0.5,
        line_fail=0.0,
        expire_fraction=None,
        enqueued_token_limit=None,
        max_file_requests=50_000,
    )
    return fresh_sim


def batch_config(sim, **settings):
    req = urllib.request.Request(
        sim.root + "/admin/batch_config", data=json.dumps(settings).encode(), method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert json.loads(resp.read())["ok"]


def resources(sim, db):
    return {
        "llm": LLMResource(base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini"),
        "warehouse": DuckDBWarehouse(database=db),
    }


def materialize(a, sim, db, key="2026-11-01"):
    return dg.materialize(
        [a], resources=resources(sim, db), partition_key=key, raise_on_error=False
    )


def metadata(result):
    mats = result.asset_materializations_for_node("sentiment")
    return {k: v.value for k, v in mats[-1].metadata.items()}


def statuses(db, key="2026-11-01"):
    return dict(
        query(
            db,
            "SELECT status, count(*) FROM news_sentiment "
            f"WHERE partition_key = '{key}' GROUP BY status",
        )
    )


def test_batch_partition_is_written_at_half_price_and_rerun_sends_nothing(bsim, db):
    result = materialize(asset(), bsim, db)
    assert result.success
    md = metadata(result)
    assert statuses(db) == {"ok": PER_DAY}
    stats = bsim.stats()
    assert stats["batches_created"] == 1 and stats["batch_lines_submitted"] == PER_DAY
    assert stats.get("received", 0) == 0  # nothing went through the live route
    assert md["mode"] == "batch" and len(md["batch_ids"]) == 1
    # Batch price: half of the live price for the same tokens (gpt-4o-mini: 0.15 / 0.60 per 1M).
    [(cost, pt, ct)] = query(
        db, "SELECT sum(cost_usd), sum(prompt_tokens), sum(completion_tokens) FROM news_sentiment"
    )
    assert cost == pytest.approx((pt * 0.15 + ct * 0.60) / 1e6 * 0.5)
    again = materialize(asset(), bsim, db)
    assert again.success and metadata(again)["rows_skipped"] == PER_DAY
    assert bsim.stats()["batches_created"] == 1
