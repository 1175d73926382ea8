"""The code location: the demo asset on embedded defaults (DuckDB file, simulator, Valkey).

Environment: BATCH_LLM_BASE_URL (default: the simulator at 127.0.0.1:8765), OPENAI_API_KEY,
BATCH_LLM_MODEL, BATCH_LLM_RPM / BATCH_LLM_TPM (limits of the key), REDIS_URL (shared limiter
state; unset: a private embedded Valkey per run), BATCH_LLM_DUCKDB (the warehouse file).
"""

from __future__ import annotations

import os
from datetime import date, timedelta

import dagster as dg

from .assets import Prompt, SourceTable, build_llm_batch_asset
from .demo_data import DEMO_DAYS, DEMO_START
from .resources import LLMResource
from .resources.duckdb_warehouse import DuckDBWarehouse

_end = (date.fromisoformat(DEMO_START) + timedelta(days=DEMO_DAYS)).isoformat()
demo_partitions = dg.DailyPartitionsDefinition(start_date=DEMO_START, end_date=_end)

headline_sentiment = build_llm_batch_asset(
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
    params={"temperature": 0, "max_tokens": 5},
    partitions_def=demo_partitions,
    group_name="demo",
)


# A job over the asset, for `dagster job backfill` and schedules.
headline_sentiment_job = dg.define_asset_job(
    "headline_sentiment_job", selection=[headline_sentiment], partitions_def=demo_partitions
)


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


defs = dg.Definitions(
    assets=[headline_sentiment],
    jobs=[headline_sentiment_job],
    resources={
        "llm": LLMResource(
            base_url=os.environ.get("BATCH_LLM_BASE_URL", "http://127.0.0.1:8765/v1"),
            api_key=dg.EnvVar("OPENAI_API_KEY") if os.environ.get("OPENAI_API_KEY") else "",
            model=os.environ.get("BATCH_LLM_MODEL", "gpt-4o-mini"),
            rpm=_int_env("BATCH_LLM_RPM"),
            tpm=_int_env("BATCH_LLM_TPM"),
            redis_url=os.environ.get("REDIS_URL") or None,
            job_key="demo",
        ),
        "warehouse": DuckDBWarehouse(
            database=os.environ.get("BATCH_LLM_DUCKDB", ".demo/warehouse.duckdb")
        ),
    },
)
