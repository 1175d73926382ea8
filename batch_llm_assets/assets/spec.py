"""LlmBatchSpec: every setting of a batch LLM asset, checked once, for Python and YAML alike.

`build_llm_batch_asset(...)` and the YAML `LlmBatchComponent` both validate through this model,
so a bad setting fails the same way from either side, before any run, with an error that names
its field path ("source.table: Invalid table name ...", "prompt.template: unknown column 'body'").
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Literal

import dagster as dg
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..engine.errors import BatchLLMError
from ..warehouses.base import check_identifier, check_table
from .batch_mode import BatchSettings
from .checks import DEFAULT_WARN_FAILED_FRACTION
from .prompt import DEFAULT_RENDER_TIMEOUT_S, Prompt
from .schema import OUTPUT_COLUMNS
from .structured import OutputSchema, parse_output_schema

TABLE_PER_PARTITION = "{partition_key}"
DEFAULT_MAX_FAILED_FRACTION = 0.05
DEFAULT_CHUNK_ROWS = 1000
DEFAULT_START_DATE = "2019-01-01"
TIME_WINDOW_TYPES = ("daily", "hourly", "weekly", "monthly")
_TIME_WINDOW_CLASSES: dict[str, type[dg.TimeWindowPartitionsDefinition]] = {
    "daily": dg.DailyPartitionsDefinition,
    "hourly": dg.HourlyPartitionsDefinition,
    "weekly": dg.WeeklyPartitionsDefinition,
    "monthly": dg.MonthlyPartitionsDefinition,
}
WAREHOUSE_KINDS = ("duckdb", "bigquery")
# Request fields the asset sets itself: not allowed in `params`.
_RESERVED_PARAMS = {
    "model": "set the model with the top-level 'model' setting",
    "messages": "the messages are rendered from 'prompt'",
}
# Well-known OpenAI chat parameters, checked for type and range: (kind, low, high).
_PARAM_RANGES: dict[str, tuple[str, float | None, float | None]] = {
    "temperature": ("number", 0, 2),
    "top_p": ("number", 0, 1),
    "presence_penalty": ("number", -2, 2),
    "frequency_penalty": ("number", -2, 2),
    "max_tokens": ("integer", 1, None),
    "max_completion_tokens": ("integer", 1, None),
    "n": ("integer", 1, None),
    "seed": ("integer", None, None),
}


class LlmBatchConfigError(BatchLLMError):
    """Invalid settings of a batch LLM asset. The description starts with the setting's path
    ("source.table: ...", "prompt.template: ..."), one line per problem."""


@contextmanager
def at(path: str) -> Iterator[None]:
    """Re-raise the library's (and Dagster's) definition errors prefixed with `path`."""
    try:
        yield
    except LlmBatchConfigError:
        raise
    except BatchLLMError as exc:
        raise LlmBatchConfigError(description=f"{path}: {exc.description}") from None
    except (ValueError, TypeError, dg.DagsterInvalidDefinitionError) as exc:
        raise LlmBatchConfigError(description=f"{path}: {exc}") from None


def fail(path: str, message: str) -> None:
    raise LlmBatchConfigError(description=f"{path}: {message}")


def describe(exc: ValidationError) -> str:
    """One 'path: message' line per pydantic error."""
    lines = []
    for err in exc.errors(include_url=False):
        path = ""
        for part in err["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        msg = "unknown attribute" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"{path}: {msg}" if path else msg)
    return "\n".join(dict.fromkeys(lines))


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceSpec(_Spec):
    """The input table and the columns the prompt may use."""

    table: str = Field(
        description="Source table: 'table', 'schema.table' or 'catalog.schema.table'. End it "
        "with '{partition_key}' (e.g. 'incoming.{partition_key}') to read one whole table per "
        "(dynamic) partition."
    )
    id_column: str = Field(default="id", description="The table's unique row id column.")
    partition_column: str | None = Field(
        default=None,
        description="Column that selects a partition's rows (a timestamp/date for time "
        "partitions, the key itself for static/dynamic ones). Required unless the table name "
        "ends with '{partition_key}'.",
    )
    columns: list[str] = Field(
        default_factory=list,
        description="Columns read and offered to the prompt. Default: the columns the prompt "
        "names.",
    )
    column_types: dict[str, str] = Field(
        default_factory=dict,
        description="The source's column types as the warehouse names them, e.g. {id: BIGINT}: "
        "shown as the source table's column schema and as the output id column's type. "
        "Default: none (types unknown when definitions load).",
    )

    @property
    def per_partition(self) -> bool:
        return self.table.endswith(TABLE_PER_PARTITION)


class PromptSpec(_Spec):
    """The chat prompt: Jinja templates over the row's columns (rendered in a sandbox)."""

    template: str = Field(
        description="User message, e.g. 'Headline: {{ headline }}'. May name only source columns."
    )
    system: str | None = Field(
        default=None, description="Optional system message; may also name source columns."
    )


class PartitionsSpec(_Spec):
    """How the asset is partitioned."""

    type: Literal["daily", "hourly", "weekly", "monthly", "static", "dynamic"] = Field(
        default="daily",
        description="Partitioning: daily, hourly, weekly, monthly, static, dynamic.",
    )
    start_date: str | None = Field(
        default=None,
        description="First partition of a time partitioning (daily/weekly/monthly "
        "'YYYY-MM-DD', hourly 'YYYY-MM-DD-HH:MM'). Required for time partitionings.",
    )
    end_date: str | None = Field(
        default=None,
        description="Exclusive end of a time partitioning; default: open-ended (up to now).",
    )
    timezone: str | None = Field(
        default=None, description="Timezone of a time partitioning (default UTC)."
    )
    values: list[str] | None = Field(
        default=None, description="The partition keys of a static partitioning (required)."
    )
    name: str | None = Field(
        default=None,
        description="Name of a dynamic partitioning (its set of keys in the instance); "
        "default: the asset name.",
    )

    def build(self, asset_name: str) -> dg.PartitionsDefinition:
        """The PartitionsDefinition; errors name `partitions.<field>`."""
        if self.type in TIME_WINDOW_TYPES:
            return self._time_window()
        for unused in ("start_date", "end_date", "timezone"):
            if getattr(self, unused) is not None:
                fail(f"partitions.{unused}", f"not used by type {self.type!r}")
        if self.type == "static":
            if self.name is not None:
                fail("partitions.name", "not used by type 'static'")
            if not self.values:
                fail("partitions.values", "required (a non-empty list) for type 'static'")
            with at("partitions.values"):
                return dg.StaticPartitionsDefinition(list(self.values or []))
        if self.values is not None:
            fail("partitions.values", "not used by type 'dynamic'")
        name = self.name if self.name is not None else asset_name
        if not name.strip():
            fail("partitions.name", "must be non-empty")
        return dg.DynamicPartitionsDefinition(name=name)

    def _time_window(self) -> dg.TimeWindowPartitionsDefinition:
        for unused in ("values", "name"):
            if getattr(self, unused) is not None:
                fail(f"partitions.{unused}", f"not used by type {self.type!r}")
        if not self.start_date:
            fail("partitions.start_date", f"required for type {self.type!r}")
        cls, start = _TIME_WINDOW_CLASSES[self.type], str(self.start_date)
        tz = {"timezone": self.timezone} if self.timezone else {}
        with at("partitions.start_date"):
            cls(start_date=start)
        with at("partitions.timezone"):
            cls(start_date=start, **tz)
        if self.end_date is None:
            return cls(start_date=start, **tz)
        with at("partitions.end_date"):
            pdef = cls(start_date=start, end_date=self.end_date, **tz)
        start_dt, end_dt = pdef.start, pdef.end
        if isinstance(start_dt, datetime) and isinstance(end_dt, datetime) and end_dt <= start_dt:
            fail("partitions.end_date", f"must be after start_date {start!r}")
        return pdef


def check_params(params: dict[str, Any], path: str = "params") -> None:
    """Request parameters the asset cannot honour, or out of their documented ranges."""
    for key, value in params.items():
        where = f"{path}.{key}"
        if key == "stream" and value:
            fail(
                where,
                f"is {value!r}: streamed answers are not supported (each would be read as "
                "malformed and retried). Remove `stream`.",
            )
        if key == "n" and (isinstance(value, bool) or value != 1):
            fail(
                where,
                f"is {value!r}: each row stores one answer, but the provider would bill n "
                "answers. Remove `n` or set it to 1.",
            )
        if key in _RESERVED_PARAMS:
            fail(where, f"not allowed: {_RESERVED_PARAMS[key]}")
        if key not in _PARAM_RANGES:
            continue
        kind, low, high = _PARAM_RANGES[key]
        number = int if kind == "integer" else int | float
        if isinstance(value, bool) or not isinstance(value, number):
            fail(where, f"must be {'an integer' if kind == 'integer' else 'a number'}")
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"within [{low}, {high}]" if high is not None else f">= {low}"
            fail(where, f"must be {bounds}, got {value}")


class BatchSpec(_Spec):
    """Batch API settings, used when mode is 'batch'."""

    wait: bool = Field(
        default=True,
        description="Poll until the partition's batches end (true), or submit and end the run "
        "(false): then a batch-completion sensor materialises the partition when they end.",
    )
    max_file_requests: int = Field(default=50_000, description="Requests per input file.")
    max_file_bytes: int = Field(default=200 * 1024 * 1024, description="Bytes per input file.")
    enqueued_token_limit: int | None = Field(
        default=None,
        description="The provider's enqueued-token limit for the model; submissions over it "
        "wait for earlier batches to end. None: no limit.",
    )
    poll_first_s: float = Field(default=2.0, description="First pause between two polls.")
    poll_max_s: float = Field(default=300.0, description="Longest pause between two polls.")
    price_factor: float = Field(
        default=0.5, description="Batch price as a fraction of the live price (0-1)."
    )
    max_resubmits: int = Field(
        default=3,
        description="Times the rows an expired or cancelled batch did not reach are submitted "
        "again; then they fail batch_expired (or batch_cancelled) and the run ends.",
    )
    sensor_interval_s: int = Field(
        default=300, description="Seconds between ticks of the batch-completion sensor."
    )

    def settings(self) -> BatchSettings:
        with at("batch"):
            return BatchSettings(
                **self.model_dump(exclude={"sensor_interval_s"}),
            )


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
