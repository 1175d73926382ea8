"""LlmBatchComponent: the batch LLM asset, its checks, schedule, sensors and estimate job, in YAML.

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

A thin Resolvable over the assets' LlmBatchSpec: the asset's settings are validated there, as
for `build_llm_batch_asset`, and every error names its attribute ("prompt.template: unknown
column 'body'"). The prompt is a Jinja template over the row's columns: it is passed through
untouched, never rendered by the loader's own `{{ env.X }}` templating.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

import dagster as dg
from pydantic import ConfigDict, Field, model_validator

from ...assets.checks import DEFAULT_WARN_FAILED_FRACTION
from ...assets.estimate_job import build_estimate_job
from ...assets.factory import build_asset_from_spec
from ...assets.lineage import source_table_spec
from ...assets.spec import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_MAX_FAILED_FRACTION,
    TIME_WINDOW_TYPES,
    BatchSpec,
    LlmBatchConfigError,
    LlmBatchSpec,
    PartitionsSpec,
    PromptSpec,
    SourceSpec,
    at,
    fail,
)
from ...sensors.batch_completion import build_batch_completion_sensor
from ...sensors.new_tables import (
    DEFAULT_MAX_TABLES_PER_TICK,
    DEFAULT_TABLES_PER_PAGE,
    build_new_input_tables_sensor,
)
from ...sensors.notifications import build_run_notification_sensors
from ...sensors.schedules import build_latest_partition_schedule
from ...warehouses.base import check_identifier

__all__ = ["LlmBatchComponent", "LlmBatchConfigError"]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
Status = Literal["running", "stopped"]


def _status(value: str, kind: Any) -> Any:
    return kind.RUNNING if value == "running" else kind.STOPPED


class ScheduleConfig(dg.Model):
    """A schedule that materialises the partition that has just closed (yesterday, for daily)."""

    hour_of_day: int = Field(default=1, description="Hour (0-23, partition timezone) to run at.")
    minute_of_hour: int = Field(default=0, description="Minute (0-59) to run at.")
    name: str | None = Field(
        default=None, description="Schedule name; default '<asset>_latest_partition'."
    )
    default_status: Status = Field(
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
    tables_per_page: int = Field(
        default=DEFAULT_TABLES_PER_PAGE,
        description="Table names listed per tick; a sweep over any number of tables continues "
        "on the next tick.",
    )
    minimum_interval_seconds: int = Field(
        default=60, description="Seconds between two evaluations of the sensor."
    )
    name: str | None = Field(
        default=None, description="Sensor name; default '<asset>_new_input_tables'."
    )
    default_status: Status = Field(
        default="stopped", description="Whether the sensor starts running when deployed."
    )


class NotificationsConfig(dg.Model):
    """Slack-compatible webhook messages when a run of this asset ends (success and failure)."""

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
    default_status: Status = Field(
        default="stopped", description="Whether the sensors start running when deployed."
    )


def _keep_literally(context: dg.ResolutionContext, value: Any) -> Any:
    """The prompt is a Jinja template for rows: never rendered with the YAML's template scope."""
    return {"template": value} if isinstance(value, str) else value


# The asset's settings, as LlmBatchSpec names and describes them ("model" is llm_model here).
_SPEC_FIELDS = [name for name in LlmBatchSpec.model_fields if name != "model"]
_d = {name: info.description or "" for name, info in LlmBatchSpec.model_fields.items()}


def _described(name: str) -> dg.Resolver:
    """A setting with a default: its description goes on the resolver, where Dagster's YAML
    schema reads it."""
    return dg.Resolver.default(description=_d[name])


class LlmBatchComponent(dg.Component, dg.Resolvable, dg.Model):
    """A partitioned asset that sends one chat request per source row and writes the answers,
    with its source table upstream, its asset checks, and optionally a latest-partition
    schedule, a new-input-tables sensor and run notifications."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)

    # -- the asset: LlmBatchSpec's settings (described there) ---------------------------------
    name: str = Field(description=_d["name"])
    source: SourceSpec = Field(description=_d["source"])
    prompt: Annotated[
        PromptSpec,
        dg.Resolver(
            _keep_literally,
            model_field_type=PromptSpec | str,
            inject_before_resolve=False,
            description=_d["prompt"],
        ),
    ]
    output: str = Field(description=_d["output"])
    # `model` in YAML; the attribute is llm_model because Resolvable.model() is taken.
    llm_model: Annotated[str | None, _described("model")] = Field(default=None, alias="model")
    params: Annotated[dict[str, Any], _described("params")] = Field(default_factory=dict)
    partitions: Annotated[PartitionsSpec | None, _described("partitions")] = None
    max_failed_fraction: Annotated[float, _described("max_failed_fraction")] = (
        DEFAULT_MAX_FAILED_FRACTION
    )
    warn_failed_fraction: Annotated[float, _described("warn_failed_fraction")] = (
        DEFAULT_WARN_FAILED_FRACTION
    )
    output_schema: Annotated[dict[str, Any] | None, _described("output_schema")] = None
    repair_attempts: Annotated[int, _described("repair_attempts")] = 1
    mode: Annotated[Literal["live", "batch"], _described("mode")] = "live"
    batch: Annotated[BatchSpec | None, _described("batch")] = None
    chunk_rows: Annotated[int, _described("chunk_rows")] = DEFAULT_CHUNK_ROWS
    render_timeout_s: Annotated[float, _described("render_timeout_s")] = 1.0
    max_prompt_chars: Annotated[int | None, _described("max_prompt_chars")] = None
    partitions_per_run: Annotated[int | None, _described("partitions_per_run")] = 1
    warehouse_kind: Annotated[Literal["duckdb", "bigquery"], _described("warehouse_kind")] = (
        "duckdb"
    )
    provider: Annotated[str | None, _described("provider")] = None
    identity_endpoint: Annotated[bool | None, _described("identity_endpoint")] = None
    reuse_answers: Annotated[bool | None, _described("reuse_answers")] = None
    pool: Annotated[str | None, _described("pool")] = None
    group_name: Annotated[str | None, _described("group_name")] = None
    description: Annotated[str | None, _described("description")] = None
    key_prefix: Annotated[list[str] | None, _described("key_prefix")] = None
    deps: Annotated[list[str] | None, _described("deps")] = None
    tags: Annotated[dict[str, str] | None, _described("tags")] = None
    owners: Annotated[list[str] | None, _described("owners")] = None
    llm_resource_key: Annotated[str, _described("llm_resource_key")] = "llm"
    warehouse_resource_key: Annotated[str, _described("warehouse_resource_key")] = "warehouse"
    # -- what the component adds around the asset --------------------------------------------
    checks: Annotated[bool, _described("checks")] = True
    schedule: Annotated[
        ScheduleConfig | None,
        dg.Resolver.default(
            description="Materialise the latest closed partition on a schedule (time partitions)."
        ),
    ] = None
    new_tables_sensor: Annotated[
        NewTablesSensorConfig | None,
        dg.Resolver.default(
            description="Turn new tables of a dataset into partitions and runs (dynamic "
            "partitions)."
        ),
    ] = None
    notifications: Annotated[
        NotificationsConfig | None,
        dg.Resolver.default(description="Post each run's end and figures to a webhook."),
    ] = None

    @classmethod
    def get_spec(cls) -> dg.ComponentTypeSpec:
        return dg.ComponentTypeSpec(
            tags=["llm", "batch"],
            produces=["asset", "asset_check", "job", "schedule", "sensor"],
        )

    def to_spec(self) -> LlmBatchSpec:
        """The asset's settings, validated (errors name the attribute)."""
        settings = {k: getattr(self, k) for k in _SPEC_FIELDS}
        return LlmBatchSpec.parse(**settings, model=self.llm_model)

    @model_validator(mode="after")
    def _check(self) -> LlmBatchComponent:
        """Checked when the YAML loads: the asset's settings, then the automation's."""
        spec = self.to_spec()
        kind = spec.partitions.type if spec.partitions else "daily"
        if self.schedule is not None:
            if kind not in TIME_WINDOW_TYPES:
                fail(
                    "schedule",
                    f"needs time partitions (partitions.type {', '.join(TIME_WINDOW_TYPES)}); "
                    f"partitions.type is {kind!r}",
                )
            if not 0 <= self.schedule.hour_of_day <= 23:
                fail("schedule.hour_of_day", f"must be 0-23, got {self.schedule.hour_of_day}")
            if not 0 <= self.schedule.minute_of_hour <= 59:
                fail("schedule.minute_of_hour", f"must be 0-59, got {self.schedule.minute_of_hour}")
        if self.new_tables_sensor is not None and kind != "dynamic":
            fail(
                "new_tables_sensor",
                "needs partitions.type 'dynamic' (one partition per table); "
                f"partitions.type is {kind!r}",
            )
        notes = self.notifications
        if notes is not None:
            if not _ENV_NAME.fullmatch(notes.webhook_url_env):
                fail(  # the value is not echoed: it may be the secret URL itself
                    "notifications.webhook_url_env",
                    "must be the name of an environment variable (letters, digits, "
                    "underscores) that holds the URL, not the URL itself",
                )
            if notes.dagster_url is not None and not notes.dagster_url.startswith(
                ("https://", "http://")
            ):
                fail("notifications.dagster_url", "must be an http(s) URL")
        return self

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        spec = self.to_spec()
        asset = build_asset_from_spec(spec)
        schedules: list[dg.ScheduleDefinition] = []
        sensors: list[dg.SensorDefinition] = []
        if self.schedule is not None:
            cfg = self.schedule
            with at("schedule"):
                schedule = build_latest_partition_schedule(
                    asset=asset,
                    name=cfg.name,
                    hour_of_day=cfg.hour_of_day,
                    minute_of_hour=cfg.minute_of_hour,
                    default_status=_status(cfg.default_status, dg.DefaultScheduleStatus),
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
            sensors.append(self._new_tables_sensor(asset))
        if self.notifications is not None:
            sensors.extend(self._notification_sensors(asset))
        if spec.mode == "batch" and spec.batch is not None and not spec.batch.wait:
            sensors.append(
                build_batch_completion_sensor(
                    asset=asset,
                    llm_resource_key=spec.llm_resource_key,
                    warehouse_resource_key=spec.warehouse_resource_key,
                    minimum_interval_seconds=spec.batch.sensor_interval_s,
                    default_status=dg.DefaultSensorStatus.RUNNING,
                )
            )
        return dg.Definitions(
            assets=[source_table_spec(asset), asset],
            jobs=[job, build_estimate_job(asset=asset)],
            schedules=schedules,
            sensors=sensors,
        )

    def _new_tables_sensor(self, asset: dg.AssetsDefinition) -> dg.SensorDefinition:
        cfg = self.new_tables_sensor
        assert cfg is not None
        for key in ("max_tables_per_tick", "tables_per_page", "minimum_interval_seconds"):
            if getattr(cfg, key) < 1:
                fail(f"new_tables_sensor.{key}", "must be >= 1")
        with at("new_tables_sensor.dataset"):
            check_identifier(cfg.dataset, "dataset")
        with at("new_tables_sensor.table_pattern"):
            try:
                re.compile(cfg.table_pattern)
            except re.error as exc:
                raise ValueError(f"not a valid regular expression: {exc}") from None
        with at("new_tables_sensor"):
            return build_new_input_tables_sensor(
                asset=asset,
                dataset=cfg.dataset,
                table_pattern=cfg.table_pattern,
                name=cfg.name,
                warehouse_resource_key=self.warehouse_resource_key,
                minimum_interval_seconds=cfg.minimum_interval_seconds,
                max_tables_per_tick=cfg.max_tables_per_tick,
                tables_per_page=cfg.tables_per_page,
                default_status=_status(cfg.default_status, dg.DefaultSensorStatus),
            )

    def _notification_sensors(self, asset: dg.AssetsDefinition) -> list[dg.SensorDefinition]:
        cfg = self.notifications
        assert cfg is not None
        path = "notifications.webhook_url_env"
        url = os.environ.get(cfg.webhook_url_env, "").strip()
        if not url:
            fail(path, f"environment variable {cfg.webhook_url_env!r} is not set")
        if not url.startswith(("https://", "http://")):  # never echo the URL: it holds a token
            fail(path, f"environment variable {cfg.webhook_url_env!r} must hold an http(s) URL")
        with at("notifications"):
            return build_run_notification_sensors(
                webhook_url=url,
                asset_keys=[asset.key],
                dagster_url=cfg.dagster_url,
                name_prefix=cfg.name_prefix or f"{self.name}_notify",
                default_status=_status(cfg.default_status, dg.DefaultSensorStatus),
            )
