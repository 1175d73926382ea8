"""The parts of an LlmBatchSpec (source, prompt, partitions, batch mode, params) and the
error helpers that name a bad setting by its field path."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Literal

import dagster as dg
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.errors import BatchLLMError
from .batch_mode import BatchSettings

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
