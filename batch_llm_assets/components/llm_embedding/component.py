"""LlmEmbeddingComponent: the embedding asset, its checks, job and schedule, declared in YAML.

    # defs/headline_embeddings/defs.yaml
    type: batch_llm_assets.components.LlmEmbeddingComponent
    attributes:
      name: headline_embeddings
      source: {table: news_headlines, partition_column: published_at}
      text: "{{ headline }}"
      output: news_embeddings
      model: text-embedding-3-small
      dimensions: 256
      partitions: {type: daily, start_date: "2026-11-01"}

A component of its own rather than a `task: embed` on LlmBatchComponent: half of that one's
attributes (prompt.system, params, output_schema, repair_attempts, typed-output checks) mean
nothing for an embedding, and the embedding's own (text, dimensions, encoding_format, truncate,
packing limits) mean nothing for a chat; one type per job keeps each YAML schema exact and its
errors specific. A thin Resolvable over LlmEmbeddingSpec, as LlmBatchComponent is over
LlmBatchSpec: errors name the attribute. `text` is a Jinja template over the row's columns,
passed through untouched, never rendered by the loader's own `{{ env.X }}` templating.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import dagster as dg
from pydantic import ConfigDict, Field, model_validator

from ...assets.lineage import source_table_spec
from ...assets.spec import TIME_WINDOW_TYPES, BatchSpec, PartitionsSpec, SourceSpec, at, fail
from ...embeddings.factory import build_embedding_asset_from_spec
from ...embeddings.spec import LlmEmbeddingSpec
from ...sensors.schedules import build_latest_partition_schedule
from ..llm_batch.component import ScheduleConfig, _status

__all__ = ["LlmEmbeddingComponent"]

_d = {name: info.description or "" for name, info in LlmEmbeddingSpec.model_fields.items()}
# The spec's settings this component offers (a chat's prompt, params and output_schema not).
_SPEC_FIELDS = [
    n
    for n in LlmEmbeddingSpec.model_fields
    if n not in ("model", "prompt", "params", "output_schema", "repair_attempts")
]


def _described(name: str) -> dg.Resolver:
    return dg.Resolver.default(description=_d[name])


def _literal(context: dg.ResolutionContext, value: Any) -> Any:
    return value


class LlmEmbeddingComponent(dg.Component, dg.Resolvable, dg.Model):
    """A partitioned asset that embeds the text of every source row into a vector column, many
    rows per request, with its source table upstream, its asset checks, a job and optionally a
    latest-partition schedule."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)

    name: str = Field(description=_d["name"])
    source: SourceSpec = Field(description=_d["source"])
    text: Annotated[
        str,
        dg.Resolver(
            _literal,
            model_field_type=str,
            inject_before_resolve=False,
            description="The text embedded: a Jinja template over the row's columns, e.g. "
            "'{{ headline }}' (filled per row, not by the YAML loader).",
        ),
    ]
    output: str = Field(description=_d["output"])
    llm_model: Annotated[str | None, _described("model")] = Field(default=None, alias="model")
    dimensions: Annotated[int | None, _described("dimensions")] = None
    encoding_format: Annotated[Literal["float", "base64"] | None, _described("encoding_format")] = (
        None
    )
    truncate: Annotated[bool, _described("truncate")] = False
    max_inputs_per_request: Annotated[int, _described("max_inputs_per_request")] = 2048
    max_tokens_per_request: Annotated[int, _described("max_tokens_per_request")] = 300_000
    max_input_tokens: Annotated[int | None, _described("max_input_tokens")] = None
    partitions: Annotated[PartitionsSpec | None, _described("partitions")] = None
    max_failed_fraction: Annotated[float, _described("max_failed_fraction")] = 0.05
    warn_failed_fraction: Annotated[float, _described("warn_failed_fraction")] = 0.01
    checks: Annotated[bool, _described("checks")] = True
    mode: Annotated[Literal["live", "batch"], _described("mode")] = "live"
    batch: Annotated[BatchSpec | None, _described("batch")] = None
    chunk_rows: Annotated[int, _described("chunk_rows")] = 1000
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
    declare_source: Annotated[
        bool,
        dg.Resolver.default(
            description="Declare the source table as an asset upstream of this one. Set false "
            "when another component of the code location declares the same table (one key, "
            "one declaration)."
        ),
    ] = True
    schedule: Annotated[
        ScheduleConfig | None,
        dg.Resolver.default(
            description="Materialise the latest closed partition on a schedule (time partitions)."
        ),
    ] = None

    @classmethod
    def get_spec(cls) -> dg.ComponentTypeSpec:
        return dg.ComponentTypeSpec(
            tags=["llm", "embeddings"], produces=["asset", "asset_check", "job", "schedule"]
        )

    def to_spec(self) -> LlmEmbeddingSpec:
        """The asset's settings, validated (errors name the attribute)."""
        settings = {k: getattr(self, k) for k in _SPEC_FIELDS}
        return LlmEmbeddingSpec.parse(**settings, text=self.text, model=self.llm_model)

    @model_validator(mode="after")
    def _check(self) -> LlmEmbeddingComponent:
        """Checked when the YAML loads."""
        self.to_spec()
        return self

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        spec = self.to_spec()
        asset = build_embedding_asset_from_spec(spec)
        schedules = []
        if self.schedule is not None:
            cfg = self.schedule
            if spec.partitions is not None and spec.partitions.type not in TIME_WINDOW_TYPES:
                fail("schedule", f"needs time partitions ({', '.join(TIME_WINDOW_TYPES)})")
            with at("schedule"):
                schedules.append(
                    build_latest_partition_schedule(
                        asset=asset,
                        name=cfg.name,
                        hour_of_day=cfg.hour_of_day,
                        minute_of_hour=cfg.minute_of_hour,
                        default_status=_status(cfg.default_status, dg.DefaultScheduleStatus),
                    )
                )
            job = schedules[0].job
        else:
            job = dg.define_asset_job(
                f"{asset.key.path[-1]}_job",
                selection=[asset.key],
                partitions_def=asset.partitions_def,
            )
        source = [source_table_spec(asset)] if self.declare_source else []
        return dg.Definitions(assets=[*source, asset], jobs=[job], schedules=schedules)
