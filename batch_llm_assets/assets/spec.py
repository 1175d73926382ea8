"""LlmBatchSpec: every setting of a batch LLM asset, checked once, for Python and YAML alike.

`build_llm_batch_asset(...)` and the YAML `LlmBatchComponent` both validate through this model,
so a bad setting fails the same way from either side, before any run, with an error that names
its field path ("source.table: Invalid table name ...", "prompt.template: unknown column 'body'").
"""

from __future__ import annotations

import re
from typing import Any, Literal

import dagster as dg
from pydantic import Field, ValidationError, model_validator

from ..engine.errors import BatchLLMError
from ..warehouses.base import check_identifier, check_table
from .batch_mode import BatchSettings
from .checks import DEFAULT_WARN_FAILED_FRACTION
from .prompt import DEFAULT_RENDER_TIMEOUT_S, Prompt
from .schema import OUTPUT_COLUMNS
from .spec_parts import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_MAX_FAILED_FRACTION,
    DEFAULT_START_DATE,
    TABLE_PER_PARTITION,
    TIME_WINDOW_TYPES,
    WAREHOUSE_KINDS,
    BatchSpec,
    LlmBatchConfigError,
    PartitionsSpec,
    PromptSpec,
    SourceSpec,
    _Spec,
    at,
    check_params,
    describe,
    fail,
)
from .structured import OutputSchema, parse_output_schema

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "DEFAULT_MAX_FAILED_FRACTION",
    "DEFAULT_START_DATE",
    "TABLE_PER_PARTITION",
    "TIME_WINDOW_TYPES",
    "WAREHOUSE_KINDS",
    "BatchSpec",
    "LlmBatchConfigError",
    "LlmBatchSpec",
    "PartitionsSpec",
    "PromptSpec",
    "SourceSpec",
    "at",
    "check_params",
    "describe",
    "fail",
]


class LlmBatchSpec(_Spec):
    """Every setting of one batch LLM asset. Build it with `LlmBatchSpec.parse(...)`."""

    name: str = Field(description="Asset name (letters, digits, underscores).")
    source: SourceSpec = Field(description="The input table.")
    prompt: PromptSpec = Field(
        description="Prompt templates over the row's columns: {template, system}, or a string "
        "(the template alone). Taken literally: '{{ column }}' is filled per row."
    )
    output: str = Field(description="Output table for the answers ('table' or 'schema.table').")
    model: str | None = Field(
        default=None,
        description="Model name; default: the LLM resource's model (recorded per run).",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Request parameters (temperature, max_tokens, seed, response_format, ...); "
        "they override the LLM resource's.",
    )
    partitions: PartitionsSpec | None = Field(
        default=None, description="Partitioning; default: daily from 2019-01-01."
    )
    max_failed_fraction: float = Field(
        default=DEFAULT_MAX_FAILED_FRACTION,
        description="Fraction (0-1) of a partition's rows that may fail before the run fails "
        "(and the failed_fraction check's threshold).",
    )
    output_schema: Any = Field(
        default=None,
        description="Typed outputs: field -> type (string, integer, number, boolean, enum, list, "
        "object) or {type, description, values, items, minimum, maximum} (in Python also a "
        "pydantic model class); the answer is asked for as JSON of that shape and each field is "
        "written to its own typed column.",
    )
    repair_attempts: int = Field(
        default=1,
        description="With output_schema: times an invalid answer is re-asked with the error "
        "(>= 0); then the row fails invalid_output.",
    )
    warn_failed_fraction: float = Field(
        default=DEFAULT_WARN_FAILED_FRACTION,
        description="Threshold (0-1) of the failed_fraction check (severity WARN): lower than "
        "max_failed_fraction, so it flags a partition that did not fail its run.",
    )
    checks: bool = Field(
        default=True,
        description="Report the asset checks failed_fraction and row_count_matches_input with "
        "every materialisation, computed from that partition's rows.",
    )
    mode: Literal["live", "batch"] = Field(
        default="live",
        description="'live': one chat request per row now; 'batch': the provider's Batch API "
        "(half price, answers within 24 h).",
    )
    batch: BatchSpec | None = Field(
        default=None, description="Batch API settings when mode is 'batch'."
    )
    chunk_rows: int = Field(
        default=DEFAULT_CHUNK_ROWS, description="Rows read and written per chunk (>= 1)."
    )
    render_timeout_s: float = Field(
        default=DEFAULT_RENDER_TIMEOUT_S,
        description="Longest time (s) rendering one row's prompt may take; past it the row fails "
        "prompt_render without being sent.",
    )
    max_prompt_chars: int | None = Field(
        default=None,
        description="Longest rendered prompt (characters); past it the row fails "
        "prompt_too_large without being sent. None: 8 per token of the model's context window.",
    )
    partitions_per_run: int | None = Field(
        default=1,
        description="Partitions a backfill puts in one run (the backfill policy). 1: each "
        "partition its own run, so partitions fail, retry and queue independently. None: one "
        "run for a whole range (what `dg launch --partition-range` needs).",
    )
    warehouse_kind: Literal["duckdb", "bigquery"] = Field(
        default="duckdb",
        description="Kind of the warehouse resource (duckdb, bigquery): the assets' kind icon "
        "and the source table's kind.",
    )
    provider: str | None = Field(
        default=None,
        description="Provider profile (openai, azure, gemini, vllm, llama.cpp, ollama, ...): "
        "the asset's kind and the default concurrency pool. Default: openai.",
    )
    identity_endpoint: bool | None = Field(
        default=None,
        description="Put the endpoint (base_url) into each request's identity, so a rerun "
        "against another endpoint sends every row again (for two endpoints that serve "
        "different models under one name). None: the LLM resource's identity_endpoint.",
    )
    reuse_answers: bool | None = Field(
        default=None,
        description="Reuse an answer stored ok in any partition of the output table for an "
        "identical request (same request_hash) instead of sending it again; the row records "
        "cost 0 and shared_from. None: on when the request's temperature is 0 (the same request "
        "gets the same answer), off otherwise. Identical requests within a partition are always "
        "sent once.",
    )
    pool: str | None = Field(
        default=None,
        description="Dagster concurrency pool of the asset's runs: one per DuckDB file (DuckDB "
        "has one writer per file) or one per provider key. Default: 'duckdb' for a DuckDB "
        "warehouse, else 'llm/<provider>'. Its limit is set in the UI or with "
        "`dagster instance concurrency set <pool> <limit>`.",
    )
    group_name: str | None = Field(default=None, description="Asset group.")
    description: str | None = Field(
        default=None, description="Asset description; default names the source and output."
    )
    key_prefix: list[str] | None = Field(default=None, description="Asset key prefix.")
    deps: list[str] | None = Field(
        default=None, description="Upstream asset keys ('a/b' for a key with a prefix)."
    )
    tags: dict[str, str] | None = Field(default=None, description="Asset tags.")
    owners: list[str] | None = Field(
        default=None, description="Asset owners (emails or 'team:name')."
    )
    llm_resource_key: str = Field(default="llm", description="Key of the LLMResource.")
    warehouse_resource_key: str = Field(
        default="warehouse", description="Key of the warehouse resource."
    )

    @classmethod
    def parse(cls, **settings: Any) -> LlmBatchSpec:
        """Validate settings; any problem raises LlmBatchConfigError naming its path."""
        prompt = settings.get("prompt")
        if isinstance(prompt, str):
            settings["prompt"] = {"template": prompt}
        try:
            return cls.model_validate(settings)
        except ValidationError as exc:
            raise LlmBatchConfigError(description=describe(exc)) from None

    @model_validator(mode="after")
    def _check(self) -> LlmBatchSpec:
        with at("name"):
            check_identifier(self.name, "asset")
        self._check_source_and_prompt()
        with at("output"):
            check_table(self.output)
        if self.model is not None and not self.model.strip():
            fail("model", "must be a non-empty model name (or be omitted)")
        check_params(self.params)
        try:  # its errors already name the field ("output_schema.label: ...")
            typed = parse_output_schema(self.output_schema, reserved=[c for c, _ in OUTPUT_COLUMNS])
        except BatchLLMError as exc:
            raise LlmBatchConfigError(description=exc.description) from None
        if typed is not None and "response_format" in self.params:
            fail(
                "params.response_format",
                "output_schema is set: it decides the answer's format (and how the provider is "
                "asked for it); drop response_format",
            )
        if self.repair_attempts < 0:
            fail("repair_attempts", f"must be >= 0, got {self.repair_attempts}")
        if not 0 <= self.max_failed_fraction <= 1:
            fail("max_failed_fraction", f"must be within [0, 1], got {self.max_failed_fraction}")
        if not 0 <= self.warn_failed_fraction <= 1:
            fail("warn_failed_fraction", f"must be within [0, 1], got {self.warn_failed_fraction}")
        if self.chunk_rows < 1:
            fail("chunk_rows", f"must be >= 1, got {self.chunk_rows}")
        if not self.render_timeout_s > 0:
            fail("render_timeout_s", f"must be > 0, got {self.render_timeout_s}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            fail("max_prompt_chars", f"must be >= 1, got {self.max_prompt_chars}")
        if self.batch is not None:
            if self.mode != "batch":
                fail("batch", "only used with mode 'batch'")
            self.batch.settings()
        if self.mode == "batch" and self.partitions_per_run != 1:
            fail("partitions_per_run", "must be 1 in mode 'batch' (one partition per run)")
        if self.partitions_per_run is not None and self.partitions_per_run < 1:
            fail("partitions_per_run", f"must be >= 1, got {self.partitions_per_run}")
        for key in ("llm_resource_key", "warehouse_resource_key"):
            with at(key):
                check_identifier(getattr(self, key), "resource key")
        for key in ("provider", "pool"):
            value = getattr(self, key)
            if value is not None and not re.fullmatch(r"[A-Za-z0-9_.\-/:]{1,100}", value):
                fail(key, f"use letters, digits and _ . - / : only, got {value!r}")
        if self.partitions is not None:
            self.partitions.build(self.name)
        return self

    def _check_source_and_prompt(self) -> None:
        src = self.source
        with at("source.table"):
            check_table(src.table.replace(TABLE_PER_PARTITION, "t"))
        with at("source.id_column"):
            check_identifier(src.id_column, "id column")
        if src.partition_column is not None:
            with at("source.partition_column"):
                check_identifier(src.partition_column, "partition column")
        elif not src.per_partition:
            fail(
                "source.partition_column",
                "required: the asset is partitioned, so name the column that selects a "
                f"partition's rows (or end source.table with '{TABLE_PER_PARTITION}' to read "
                "one table per partition)",
            )
        for i, column in enumerate(src.columns):
            with at(f"source.columns[{i}]"):
                check_identifier(column)
        used: dict[str, set[str]] = {}
        with at("prompt.template"):
            used["template"] = Prompt(template=self.prompt.template).variables()
        if self.prompt.system is not None:
            if not self.prompt.system.strip():
                fail("prompt.system", "must be a non-empty string (or be omitted)")
            with at("prompt.system"):
                used["system"] = Prompt(template="-", system=self.prompt.system).variables()
        known = set(src.columns)
        for label, names in used.items():
            for name in sorted(names):
                with at(f"prompt.{label}"):
                    check_identifier(name, "column")
            unknown = sorted(names - known) if known else []
            if unknown:
                noun = "column" if len(unknown) == 1 else "columns"
                fail(
                    f"prompt.{label}",
                    f"unknown {noun} {', '.join(repr(u) for u in unknown)}; source.columns "
                    f"provides {sorted(known)}",
                )

    # -- what the factory derives ---------------------------------------------------------------

    @property
    def columns(self) -> tuple[str, ...]:
        """Columns read: those named, else those the prompt uses."""
        return tuple(self.source.columns) or tuple(sorted(self.prompt_obj.variables()))

    @property
    def typed(self) -> OutputSchema | None:
        """The parsed output_schema (typed outputs), or None."""
        return parse_output_schema(self.output_schema, reserved=[c for c, _ in OUTPUT_COLUMNS])

    @property
    def prompt_obj(self) -> Prompt:
        return Prompt(template=self.prompt.template, system=self.prompt.system)

    @property
    def provider_kind(self) -> str:
        return (self.provider or "openai").lower()

    @property
    def pool_name(self) -> str:
        if self.pool:
            return self.pool
        return "duckdb" if self.warehouse_kind == "duckdb" else f"llm/{self.provider_kind}"

    def partitions_def(self) -> dg.PartitionsDefinition:
        if self.partitions is None:
            return dg.DailyPartitionsDefinition(start_date=DEFAULT_START_DATE)
        return self.partitions.build(self.name)

    def batch_settings(self) -> BatchSettings:
        return (self.batch or BatchSpec()).settings()

    def backfill_policy(self) -> dg.BackfillPolicy:
        if self.partitions_per_run is None:
            return dg.BackfillPolicy.single_run()
        return dg.BackfillPolicy.multi_run(self.partitions_per_run)
