"""The code location `batch-llm-assets`: the demo asset on embedded defaults (DuckDB file,
simulator, Valkey), or on any provider and Redis the environment names.

The asset, its source table, checks, job and schedule are declared in YAML through
LlmBatchComponent (defs/headline_sentiment/defs.yaml); this module adds the resources, each
setting read from the environment (unset: the resource's default):

| variable | LLMResource field |
| --- | --- |
| BATCH_LLM_BASE_URL | base_url (default: the simulator at 127.0.0.1:8765) |
| OPENAI_API_KEY | api_key (unset: no key, for a local server) |
| BATCH_LLM_MODEL | model (default gpt-4o-mini) |
| BATCH_LLM_PROVIDER | provider profile (openai, azure, gemini, vllm, llama.cpp, ollama) |
| BATCH_LLM_RPM, BATCH_LLM_TPM | rpm, tpm: the key's limits |
| BATCH_LLM_CONTEXT_WINDOW | context_window |
| BATCH_LLM_MAX_CONCURRENCY | max_concurrency |
| BATCH_LLM_REQUEST_TIMEOUT_S | request_timeout_s |
| BATCH_LLM_PRICE_INPUT_PER_1M, BATCH_LLM_PRICE_OUTPUT_PER_1M | price_input_per_1m, price_output_per_1m |
| BATCH_LLM_PRICE_CACHED_INPUT_PER_1M | price_cached_input_per_1m |
| BATCH_LLM_PRICE_AS_MODEL | price_as_model (default on the simulator: gpt-4o-mini) |
| REDIS_URL | redis_url (unset: a private embedded Valkey per run) |
| BATCH_LLM_DUCKDB | the DuckDB warehouse file (default .demo/warehouse.duckdb) |
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import dagster as dg

from .assets import with_limits_metadata
from .components import load_defs_folder
from .resources import LLMResource
from .resources.duckdb_warehouse import DuckDBWarehouse

CODE_LOCATION = "batch-llm-assets"
DEFAULT_BASE_URL = "http://127.0.0.1:8765/v1"

# Environment variable -> (LLMResource field, parser).
LLM_ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "BATCH_LLM_BASE_URL": ("base_url", str),
    "BATCH_LLM_MODEL": ("model", str),
    "BATCH_LLM_PROVIDER": ("provider", str),
    "BATCH_LLM_RPM": ("rpm", int),
    "BATCH_LLM_TPM": ("tpm", int),
    "BATCH_LLM_CONTEXT_WINDOW": ("context_window", int),
    "BATCH_LLM_MAX_CONCURRENCY": ("max_concurrency", int),
    "BATCH_LLM_REQUEST_TIMEOUT_S": ("request_timeout_s", float),
    "BATCH_LLM_PRICE_INPUT_PER_1M": ("price_input_per_1m", float),
    "BATCH_LLM_PRICE_OUTPUT_PER_1M": ("price_output_per_1m", float),
    "BATCH_LLM_PRICE_CACHED_INPUT_PER_1M": ("price_cached_input_per_1m", float),
    "BATCH_LLM_PRICE_AS_MODEL": ("price_as_model", str),
    "REDIS_URL": ("redis_url", str),
}


def llm_settings(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """LLMResource settings from the environment; a bad value names its variable."""
    env = os.environ if environ is None else environ
    settings: dict[str, Any] = {"base_url": DEFAULT_BASE_URL, "model": "gpt-4o-mini"}
    for var, (name, parse) in LLM_ENV.items():
        raw = env.get(var, "").strip()
        if not raw:
            continue
        if name not in LLMResource.model_fields:
            raise ValueError(f"{var} is set but this version's LLMResource has no {name!r}")
        try:
            settings[name] = parse(raw)
        except ValueError:
            kind = "an integer" if parse is int else "a number"
            raise ValueError(f"{var} must be {kind}, got {raw!r}") from None
    # The key from the environment at run time; without one (a local server) no EnvVar, which
    # would fail on a missing variable.
    settings["api_key"] = dg.EnvVar("OPENAI_API_KEY") if env.get("OPENAI_API_KEY") else ""
    settings["job_key"] = "demo"
    if settings["base_url"] == DEFAULT_BASE_URL and "price_as_model" not in settings:
        # The simulator stands in for the model it names: show what the run would cost there.
        settings["price_as_model"] = settings["model"]
    return settings


def _resources() -> dict[str, Any]:
    return {
        "llm": LLMResource(**llm_settings()),
        "warehouse": DuckDBWarehouse(
            database=os.environ.get("BATCH_LLM_DUCKDB", ".demo/warehouse.duckdb")
        ),
    }


def _load() -> tuple[dg.Definitions, dg.AssetsDefinition, Any]:
    """The YAML-declared defs plus the resources; and the demo asset and its job in them."""
    component_defs = load_defs_folder("batch_llm_assets.defs")
    key = dg.AssetKey("headline_sentiment")
    asset = next(
        a
        for a in component_defs.assets or []
        if isinstance(a, dg.AssetsDefinition) and key in a.keys
    )
    job = next(j for j in component_defs.jobs or [] if j.name == "headline_sentiment_job")
    resources = _resources()
    component_defs = with_limits_metadata(component_defs, resources["llm"])
    asset = next(a for a in component_defs.assets or [] if key in getattr(a, "keys", ()))
    return dg.Definitions.merge(component_defs, dg.Definitions(resources=resources)), asset, job


# `headline_sentiment` (the asset) and `headline_sentiment_job` (its partitioned job, which the
# schedule targets) are kept by name for tests and scripts.
defs, headline_sentiment, headline_sentiment_job = _load()
demo_partitions = headline_sentiment.partitions_def
