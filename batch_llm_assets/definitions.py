"""The code location: the demo asset on embedded defaults (DuckDB file, simulator, Valkey).

The asset, its checks, job and schedule are declared in YAML through LlmBatchComponent
(defs/headline_sentiment/defs.yaml, loaded with batch_llm_assets.components.load_defs_folder);
this module adds the resources.

Environment: BATCH_LLM_BASE_URL (default: the simulator at 127.0.0.1:8765), OPENAI_API_KEY,
BATCH_LLM_MODEL, BATCH_LLM_RPM / BATCH_LLM_TPM (limits of the key), REDIS_URL (shared limiter
state; unset: a private embedded Valkey per run), BATCH_LLM_DUCKDB (the warehouse file).
"""

from __future__ import annotations

import os
from typing import Any

import dagster as dg

from .components import load_defs_folder
from .resources import LLMResource
from .resources.duckdb_warehouse import DuckDBWarehouse


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


_resources = {
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
}


def _load() -> tuple[dg.Definitions, dg.AssetsDefinition, Any]:
    """The YAML-declared defs plus the resources; and the demo asset and its job in them.

    (A local: dagster's `-m` loader accepts one Definitions object at module scope, `defs`.)
    """
    component_defs = load_defs_folder("batch_llm_assets.defs")
    key = dg.AssetKey("headline_sentiment")
    asset = next(
        a
        for a in component_defs.assets or []
        if isinstance(a, dg.AssetsDefinition) and key in a.keys
    )
    job = next(j for j in component_defs.jobs or [] if j.name == "headline_sentiment_job")
    return dg.Definitions.merge(component_defs, dg.Definitions(resources=_resources)), asset, job


# `headline_sentiment` (the asset) and `headline_sentiment_job` (its partitioned job, which the
# schedule targets; for `dagster job backfill`) are kept by name for tests and scripts.
defs, headline_sentiment, headline_sentiment_job = _load()
demo_partitions = headline_sentiment.partitions_def
