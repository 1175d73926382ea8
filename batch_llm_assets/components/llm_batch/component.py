"""LlmBatchComponent: the batch LLM asset, its checks, schedule and sensors, declared in YAML.

    # defs/headline_sentiment/defs.yaml
    type: batch_llm_assets.components.LlmBatchComponent
    attributes:
      name: headline_sentiment
      source: {table: news_headlines, partition_column: published_at, columns: [headline]}
      prompt:
        system: You are a financial news analyst. Reply with a single word.
        template: "Headline: {{ headline }}\\nAnswer with one of: positive, negative, neutral"
      output: news_sentiment
      partitions: {type: daily, start_date: "2026-11-01", end_date: "2026-11-11"}
      schedule: {hour_of_day: 1}

The component only wraps the Python builders (build_llm_batch_asset, build_llm_batch_checks,
build_latest_partition_schedule, build_new_input_tables_sensor, build_run_notification_sensors),
so YAML and Python declare exactly the same definitions. Everything is checked when the code
location loads, and every error names the attribute it is about, e.g.
"prompt.template: unknown column 'body'".

The prompt is a Jinja template over the row's columns: it is passed through untouched, never
rendered by the component loader's own `{{ env.X }}` templating (which applies to the other
top-level string attributes).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Annotated, Any, Literal, NoReturn

import dagster as dg
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from ...assets.checks import build_llm_batch_checks
from ...assets.factory import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_MAX_FAILED_FRACTION,
    TABLE_PER_PARTITION,
    SourceTable,
    build_llm_batch_asset,
)
from ...assets.prompt import Prompt
from ...engine.errors import BatchLLMError
from ...sensors.new_tables import DEFAULT_MAX_TABLES_PER_TICK, build_new_input_tables_sensor
from ...sensors.notifications import build_run_notification_sensors
from ...sensors.schedules import build_latest_partition_schedule
from ...warehouses.base import check_identifier, check_table

TIME_WINDOW_TYPES = ("daily", "hourly", "weekly", "monthly")
_TIME_WINDOW_CLASSES: dict[str, type[dg.TimeWindowPartitionsDefinition]] = {
    "daily": dg.DailyPartitionsDefinition,
    "hourly": dg.HourlyPartitionsDefinition,
    "weekly": dg.WeeklyPartitionsDefinition,
    "monthly": dg.MonthlyPartitionsDefinition,
}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Request fields the asset sets itself: not allowed in `params`.
_RESERVED_PARAMS = {
    "model": "set the model with the top-level 'model' attribute",
    "messages": "the messages are rendered from 'prompt'",
    "stream": "batch requests are never streamed",
}
# Well-known OpenAI chat parameters, checked for type and range at load: (kind, low, high).
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
    """Invalid LlmBatchComponent attributes. The description starts with the attribute's path
    ("source.table: ...", "prompt.template: ..."), one line per problem."""


@contextlib.contextmanager
def _at(path: str) -> Iterator[None]:
    """Re-raise the library's (and Dagster's) definition errors prefixed with `path`."""
    try:
        yield
    except LlmBatchConfigError:
        raise
    except BatchLLMError as exc:
        raise LlmBatchConfigError(description=f"{path}: {exc.description}") from None
    except (ValueError, TypeError, dg.DagsterInvalidDefinitionError) as exc:
        raise LlmBatchConfigError(description=f"{path}: {exc}") from None
    except Exception as exc:
        if type(exc).__name__ == "CheckError":  # dagster._check errors: bad arguments
            raise LlmBatchConfigError(description=f"{path}: {exc}") from None
        raise


def _fail(path: str, message: str) -> NoReturn:
    raise LlmBatchConfigError(description=f"{path}: {message}")


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _describe(errors: list[Any]) -> str:
    """One 'path: message' line per pydantic error."""
    lines = []
    for err in errors:
        path = _dotted(tuple(err["loc"]))
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown attribute"
        lines.append(f"{path}: {msg}" if path else msg)
    return "\n".join(dict.fromkeys(lines))


def _is_template(value: Any) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def _status(value: str, kind: type[dg.DefaultSensorStatus] | type[dg.DefaultScheduleStatus]):
    return kind.RUNNING if value == "running" else kind.STOPPED


# --- nested attributes ------------------------------------------------------------------------
# Plain models (not Resolvable): validated as a whole, and their strings are taken literally.


class SourceConfig(dg.Model):
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


class PromptConfig(dg.Model):
    """The chat prompt: Jinja templates over the row's columns (rendered in a sandbox)."""

    template: str = Field(
        description="User message, e.g. 'Headline: {{ headline }}'. May name only source columns."
    )
    system: str | None = Field(
        default=None, description="Optional system message; may also name source columns."
    )


class PartitionsConfig(dg.Model):
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


class ScheduleConfig(dg.Model):
    """A schedule that materialises the partition that has just closed (yesterday, for daily)."""

    hour_of_day: int = Field(default=1, description="Hour (0-23, partition timezone) to run at.")
    minute_of_hour: int = Field(default=0, description="Minute (0-59) to run at.")
    name: str | None = Field(
        default=None, description="Schedule name; default '<asset>_latest_partition'."
    )
    default_status: Literal["running", "stopped"] = Field(
        default="stopped", description="Whether the schedule starts running when deployed."
    )


class NewTablesSensorConfig(dg.Model):
    """A sensor that turns each new table of a dataset into a dynamic partition and a run."""

    dataset: str = Field(description="Dataset (schema) to watch for new input tables.")
    table_pattern: str = Field(
        description="Regular expression that a table's whole name must match."
    )
    max_tables_per_tick: int = Field(
        default=DEFAULT_MAX_TABLES_PER_TICK,
        description="Most new tables turned into partitions and runs per tick.",
    )
    minimum_interval_seconds: int = Field(
        default=60, description="Seconds between two evaluations of the sensor."
    )
    name: str | None = Field(
        default=None, description="Sensor name; default '<asset>_new_input_tables'."
    )
    default_status: Literal["running", "stopped"] = Field(
        default="stopped", description="Whether the sensor starts running when deployed."
    )


class NotificationsConfig(dg.Model):
    """Slack-compatible webhook messages when a run ends (success and failure)."""

    webhook_url_env: str = Field(
        description="Name of the environment variable holding the webhook URL (a secret: the "
        "URL itself never goes in YAML). Must be set when the code location loads."
    )
    dagster_url: str | None = Field(
        default=None, description="Base URL of the Dagster UI, to link each run in the message."
    )
    name_prefix: str | None = Field(
        default=None, description="Prefix of the two sensors' names; default '<asset>_notify'."
    )
    default_status: Literal["running", "stopped"] = Field(
        default="stopped", description="Whether the sensors start running when deployed."
    )


def _keep_literally(context: dg.ResolutionContext, value: Any) -> Any:
    """The prompt is a Jinja template for rows: never rendered with the YAML's template scope."""
    return value


# --- the component ----------------------------------------------------------------------------


class LlmBatchComponent(dg.Component, dg.Resolvable, dg.Model):
    """A partitioned asset that sends one chat request per source row and writes the answers,
    with its asset checks, and optionally a latest-partition schedule, a new-input-tables sensor
    and run notifications.

    Every attribute is checked when the code location loads; an error names the attribute
    (e.g. "source.table: ...", "prompt.template: unknown column 'body'").
    """

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)

    name: str = Field(description="Asset name (letters, digits, underscores).")
    source: SourceConfig = Field(description="The input table.")
    prompt: Annotated[
        PromptConfig,
        dg.Resolver(
            _keep_literally, model_field_type=PromptConfig | str, inject_before_resolve=False
        ),
    ] = Field(
        description="Prompt templates over the row's columns: {template, system}, or a string "
        "(the template alone). Taken literally: '{{ column }}' is filled per row."
    )
    output: str = Field(description="Output table for the answers ('table' or 'schema.table').")
    # `model` in YAML; the attribute is llm_model because Resolvable.model() is taken.
    llm_model: str | None = Field(
        default=None,
        alias="model",
        description="Model name; default: the LLM resource's model.",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Request parameters (temperature, max_tokens, seed, response_format, ...); "
        "they override the LLM resource's.",
    )
    partitions: PartitionsConfig | None = Field(
        default=None, description="Partitioning; default: daily from 2019-01-01."
    )
    # -- typed outputs (assets/structured.py) --
    output_schema: dict[str, Any] | None = Field(
        default=None,
        description="Typed outputs: field -> type (string, integer, number, boolean, enum, list, "
        "object) or {type, description, values, items, minimum, maximum}; each field is written "
        "to its own typed column.",
    )
    repair_attempts: int = Field(
        default=1,
        ge=0,
        description="With output_schema: times an invalid answer is re-asked with the error.",
    )
    max_failed_fraction: float = Field(
        default=DEFAULT_MAX_FAILED_FRACTION,
        description="Fraction (0-1) of a partition's rows that may fail before the run fails "
        "(and the failed_fraction check's threshold).",
    )
    chunk_rows: int = Field(
        default=DEFAULT_CHUNK_ROWS, description="Rows read and written per chunk (>= 1)."
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
    checks: bool = Field(
        default=True,
        description="Add the asset checks failed_fraction and row_count_matches_input.",
    )
    schedule: ScheduleConfig | None = Field(
        default=None,
        description="Materialise the latest closed partition on a schedule (time partitions).",
    )
    new_tables_sensor: NewTablesSensorConfig | None = Field(
        default=None,
        description="Turn new tables of a dataset into partitions and runs (dynamic partitions).",
    )
    notifications: NotificationsConfig | None = Field(
        default=None, description="Post each run's end and figures to a webhook."
    )
    llm_resource_key: str = Field(default="llm", description="Key of the LLMResource.")
    warehouse_resource_key: str = Field(
        default="warehouse", description="Key of the warehouse resource."
    )

    @classmethod
    def get_spec(cls) -> dg.ComponentTypeSpec:
        return dg.ComponentTypeSpec(
            tags=["llm", "batch"],
            produces=["asset", "asset_check", "job", "schedule", "sensor"],
        )

    # -- loading: attribute errors name their path ---------------------------------------------

    @classmethod
    def model(cls) -> type[BaseModel]:
        """The YAML schema Dagster derives, whose errors are re-raised naming their attribute."""
        return _yaml_model(cls)

    @classmethod
    def load(cls, attributes: BaseModel | None, context: dg.ComponentLoadContext):
        try:
            return super().load(attributes, context)
        except ValidationError as exc:
            raise LlmBatchConfigError(
                description=_describe(exc.errors(include_url=False))
            ) from None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shorthand(cls, value: Any) -> Any:
        return {"template": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> LlmBatchComponent:
        """The checks build_llm_batch_asset and the sensor builders make, per attribute."""
        with _at("name"):
            check_identifier(self.name, "asset")
        self._check_source_and_prompt()
        with _at("output"):
            check_table(self.output)
        if self.llm_model is not None and not self.llm_model.strip():
            _fail("model", "must be a non-empty model name (or be omitted)")
        self._check_params()
        if not 0 <= self.max_failed_fraction <= 1:
            _fail("max_failed_fraction", f"must be within [0, 1], got {self.max_failed_fraction}")
        if self.chunk_rows < 1:
            _fail("chunk_rows", f"must be >= 1, got {self.chunk_rows}")
        for key in ("llm_resource_key", "warehouse_resource_key"):
            with _at(key):
                check_identifier(getattr(self, key), "resource key")
        self.partitions_def()  # raises naming partitions.<field>
        self._check_automation()
        return self

    def _check_source_and_prompt(self) -> None:
        src = self.source
        per_partition = src.table.endswith(TABLE_PER_PARTITION)
        with _at("source.table"):
            check_table(src.table.replace(TABLE_PER_PARTITION, "t"))
        with _at("source.id_column"):
            check_identifier(src.id_column, "id column")
        if src.partition_column is not None:
            with _at("source.partition_column"):
                check_identifier(src.partition_column, "partition column")
        elif not per_partition:
            _fail(
                "source.partition_column",
                "required: the asset is partitioned, so name the column that selects a "
                f"partition's rows (or end source.table with '{TABLE_PER_PARTITION}' to read "
                "one table per partition)",
            )
        for i, column in enumerate(src.columns):
            with _at(f"source.columns[{i}]"):
                check_identifier(column)
        used: dict[str, set[str]] = {}
        with _at("prompt.template"):
            used["template"] = Prompt(template=self.prompt.template).variables()
        if self.prompt.system is not None:
            if not self.prompt.system.strip():
                _fail("prompt.system", "must be a non-empty string (or be omitted)")
            with _at("prompt.system"):
                used["system"] = Prompt(template="-", system=self.prompt.system).variables()
        if src.columns:
            known = set(src.columns)
            for label, names in used.items():
                unknown = sorted(names - known)
                if unknown:
                    listed = ", ".join(repr(u) for u in unknown)
                    noun = "column" if len(unknown) == 1 else "columns"
                    _fail(
                        f"prompt.{label}",
                        f"unknown {noun} {listed}; source.columns provides {sorted(known)}",
                    )
        else:
            for label, names in used.items():
                for name in sorted(names):
                    with _at(f"prompt.{label}"):
                        check_identifier(name, "column")

    def _check_params(self) -> None:
        for key, value in self.params.items():
            path = f"params.{key}"
            if key in _RESERVED_PARAMS:
                _fail(path, f"not allowed: {_RESERVED_PARAMS[key]}")
            if key not in _PARAM_RANGES:
                continue
            kind, low, high = _PARAM_RANGES[key]
            if isinstance(value, bool) or not isinstance(
                value, int if kind == "integer" else int | float
            ):
                _fail(path, f"must be {'an integer' if kind == 'integer' else 'a number'}")
            if (low is not None and value < low) or (high is not None and value > high):
                bounds = f"within [{low}, {high}]" if high is not None else f">= {low}"
                _fail(path, f"must be {bounds}, got {value}")

    def _check_automation(self) -> None:
        kind = self.partitions.type if self.partitions else "daily"
        if self.schedule is not None:
            if kind not in TIME_WINDOW_TYPES:
                _fail(
                    "schedule",
                    f"needs time partitions (partitions.type {', '.join(TIME_WINDOW_TYPES)}); "
                    f"partitions.type is {kind!r}",
                )
            if not 0 <= self.schedule.hour_of_day <= 23:
                _fail("schedule.hour_of_day", f"must be 0-23, got {self.schedule.hour_of_day}")
            if not 0 <= self.schedule.minute_of_hour <= 59:
                _fail(
                    "schedule.minute_of_hour",
                    f"must be 0-59, got {self.schedule.minute_of_hour}",
                )
        sensor = self.new_tables_sensor
        if sensor is not None:
            if kind != "dynamic":
                _fail(
                    "new_tables_sensor",
                    f"needs partitions.type 'dynamic' (one partition per table); "
                    f"partitions.type is {kind!r}",
                )
            with _at("new_tables_sensor.dataset"):
                check_identifier(sensor.dataset, "dataset")
            try:
                re.compile(sensor.table_pattern)
            except re.error as exc:
                _fail("new_tables_sensor.table_pattern", f"not a valid regular expression: {exc}")
            if sensor.max_tables_per_tick < 1:
                _fail("new_tables_sensor.max_tables_per_tick", "must be >= 1")
            if sensor.minimum_interval_seconds < 1:
                _fail("new_tables_sensor.minimum_interval_seconds", "must be >= 1")
        notes = self.notifications
        if notes is not None:
            if not _ENV_NAME.match(notes.webhook_url_env):
                _fail(  # the value is not echoed: it may be the secret URL itself
                    "notifications.webhook_url_env",
                    "must be the name of an environment variable (letters, digits, "
                    "underscores) that holds the URL, not the URL itself",
                )
            if notes.dagster_url is not None and not notes.dagster_url.startswith(
                ("https://", "http://")
            ):
                _fail("notifications.dagster_url", "must be an http(s) URL")

    # -- building ------------------------------------------------------------------------------

    def partitions_def(self) -> dg.PartitionsDefinition | None:
        """The partitioning; None for the factory's default (daily from 2019-01-01)."""
        p = self.partitions
        if p is None:
            return None
        if p.type in TIME_WINDOW_TYPES:
            for unused in ("values", "name"):
                if getattr(p, unused) is not None:
                    _fail(f"partitions.{unused}", f"not used by type {p.type!r}")
            if not p.start_date:
                _fail("partitions.start_date", f"required for type {p.type!r}")
            cls = _TIME_WINDOW_CLASSES[p.type]
            tz = {"timezone": p.timezone} if p.timezone else {}
            with _at("partitions.timezone" if p.timezone else "partitions.start_date"):
                cls(start_date=p.start_date, **tz)
            with _at("partitions.start_date"):
                cls(start_date=p.start_date)
            if p.end_date is None:
                return cls(start_date=p.start_date, **tz)
            with _at("partitions.end_date"):
                pdef = cls(start_date=p.start_date, end_date=p.end_date, **tz)
            start, end = pdef.start, pdef.end
            if isinstance(start, datetime) and isinstance(end, datetime) and end <= start:
                _fail("partitions.end_date", f"must be after start_date {p.start_date!r}")
            return pdef
        for unused in ("start_date", "end_date", "timezone"):
            if getattr(p, unused) is not None:
                _fail(f"partitions.{unused}", f"not used by type {p.type!r}")
        if p.type == "static":
            if p.name is not None:
                _fail("partitions.name", "not used by type 'static'")
            if not p.values:
                _fail("partitions.values", "required (a non-empty list) for type 'static'")
            with _at("partitions.values"):
                return dg.StaticPartitionsDefinition(list(p.values))
        if p.values is not None:
            _fail("partitions.values", "not used by type 'dynamic'")
        name = p.name if p.name is not None else self.name
        if not name.strip():
            _fail("partitions.name", "must be non-empty")
        return dg.DynamicPartitionsDefinition(name=name)

    def build_asset(self) -> dg.AssetsDefinition:
        with _at(f"LlmBatchComponent {self.name!r}"):
            return build_llm_batch_asset(
                name=self.name,
                source=SourceTable(
                    table=self.source.table,
                    id_column=self.source.id_column,
                    partition_column=self.source.partition_column,
                    columns=tuple(self.source.columns),
                ),
                prompt=Prompt(template=self.prompt.template, system=self.prompt.system),
                output=self.output,
                model=self.llm_model,
                params=self.params,
                partitions_def=self.partitions_def(),
                max_failed_fraction=self.max_failed_fraction,
                chunk_rows=self.chunk_rows,
                llm_resource_key=self.llm_resource_key,
                warehouse_resource_key=self.warehouse_resource_key,
                key_prefix=self.key_prefix,
                group_name=self.group_name,
                description=self.description,
                deps=[dg.AssetKey.from_user_string(d) for d in self.deps or []],
                tags=self.tags,
                owners=self.owners,
                output_schema=self.output_schema,
                repair_attempts=self.repair_attempts,
            )

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        asset = self.build_asset()
        checks = (
            build_llm_batch_checks(asset, max_failed_fraction=self.max_failed_fraction)
            if self.checks
            else []
        )
        schedules: list[dg.ScheduleDefinition] = []
        sensors: list[dg.SensorDefinition] = []
        if self.schedule is not None:
            with _at("schedule"):
                schedule = build_latest_partition_schedule(
                    asset=asset,
                    name=self.schedule.name,
                    hour_of_day=self.schedule.hour_of_day,
                    minute_of_hour=self.schedule.minute_of_hour,
                    default_status=_status(self.schedule.default_status, dg.DefaultScheduleStatus),
                )
            schedules.append(schedule)
            job = schedule.job  # the same '<asset>_job' the schedule targets
        else:
            job = dg.define_asset_job(
                f"{asset.key.path[-1]}_job",
                selection=[asset.key],
                partitions_def=asset.partitions_def,
            )
        if self.new_tables_sensor is not None:
            cfg = self.new_tables_sensor
            with _at("new_tables_sensor"):
                sensors.append(
                    build_new_input_tables_sensor(
                        asset=asset,
                        dataset=cfg.dataset,
                        table_pattern=cfg.table_pattern,
                        name=cfg.name,
                        warehouse_resource_key=self.warehouse_resource_key,
                        minimum_interval_seconds=cfg.minimum_interval_seconds,
                        max_tables_per_tick=cfg.max_tables_per_tick,
                        default_status=_status(cfg.default_status, dg.DefaultSensorStatus),
                    )
                )
        if self.notifications is not None:
            sensors.extend(self._notification_sensors())
        return dg.Definitions(
            assets=[asset],
            asset_checks=checks,
            jobs=[job],
            schedules=schedules,
            sensors=sensors,
        )

    def _notification_sensors(self) -> list[dg.SensorDefinition]:
        cfg = self.notifications
        assert cfg is not None
        path = "notifications.webhook_url_env"
        url = os.environ.get(cfg.webhook_url_env, "").strip()
        if not url:
            _fail(path, f"environment variable {cfg.webhook_url_env!r} is not set")
        if not url.startswith(("https://", "http://")):  # never echo the URL: it holds a token
            _fail(path, f"environment variable {cfg.webhook_url_env!r} must hold an http(s) URL")
        with _at("notifications"):
            return build_run_notification_sensors(
                webhook_url=url,
                dagster_url=cfg.dagster_url,
                name_prefix=cfg.name_prefix or f"{self.name}_notify",
                default_status=_status(cfg.default_status, dg.DefaultSensorStatus),
            )


@functools.cache
def _yaml_model(component_cls: type[LlmBatchComponent]) -> type[BaseModel]:
    """Dagster's derived YAML model, with
    - every attribute's description (Dagster keeps only those of required fields), and
    - its validation errors re-raised as LlmBatchConfigError naming each attribute
      ("source.table: Field required")."""
    derived = dg.Resolvable.model.__func__(component_cls)  # type: ignore[attr-defined]
    described = {}
    for py_name, info in component_cls.model_fields.items():
        yaml_info = derived.model_fields.get(py_name)
        if yaml_info is not None and info.description and not yaml_info.description:
            described[py_name] = (
                yaml_info.annotation,
                FieldInfo.merge_field_infos(yaml_info, description=info.description),
            )

    def named_errors(cls: type[BaseModel], data: Any, handler: Any) -> Any:
        try:
            return handler(data)
        except ValidationError as exc:
            raise LlmBatchConfigError(description=_yaml_errors(component_cls, data, exc)) from None

    model = create_model(  # type: ignore[call-overload]
        derived.__name__,
        __base__=derived,
        __module__=derived.__module__,
        __validators__={"_named_errors": model_validator(mode="wrap")(classmethod(named_errors))},
        **described,
    )
    extra = model.model_config.get("json_schema_extra")
    if isinstance(extra, dict) and "ui:order" in extra:  # the YAML names, e.g. model, not llm_model
        aliases = {k: i.alias for k, i in component_cls.model_fields.items() if i.alias}
        extra = {**extra, "ui:order": [aliases.get(k, k) for k in extra["ui:order"]]}
        model.model_config["json_schema_extra"] = extra
        model.model_rebuild(force=True)
    return model


def _yaml_errors(component_cls: type[BaseModel], data: Any, exc: ValidationError) -> str:
    """Errors of raw YAML attributes, named by path. Dagster's derived schema accepts a template
    string anywhere, so its errors list one branch per alternative ("source.SourceConfig.table",
    "source.str"); validating against the component's own types gives one clean error each.
    """
    if isinstance(data, Mapping):
        try:
            component_cls.model_validate(dict(data))
        except ValidationError as own:
            errors = [
                e
                for e in own.errors(include_url=False)
                if not _is_template(e.get("input"))  # templates are rendered later
            ]
            if errors:
                return _describe(errors)
        except LlmBatchConfigError as own:
            return own.description or str(own)
    return _describe(exc.errors(include_url=False))
