"""build_llm_batch_asset: a partitioned asset that runs an LLM over every row of a table slice."""

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
from pydantic import BaseModel

from ..engine.errors import BatchLLMError
from ..resources.llm import LLMResource
from ..warehouses.base import SliceFilter, SourceRef, Warehouse, check_table
from .batch_mode import BatchSettings
from .batch_results import materialize_batch_partition
from .checks import DEFAULT_WARN_FAILED_FRACTION, check_results, check_specs, judge_partition
from .lineage import asset_kinds, definition_metadata, source_key
from .metadata import build_metadata
from .pipeline import PartitionRun, RunSpec
from .prompt import DEFAULT_RENDER_TIMEOUT_S, CompiledPrompt, Prompt
from .schema import output_table
from .spec import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_MAX_FAILED_FRACTION,
    TABLE_PER_PARTITION,
    LlmBatchSpec,
    at,
)
from .structured import (
    OutputSchema,
    field_check_results,
    field_check_specs,
    field_quality,
    quality_metadata,
)

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "DEFAULT_MAX_FAILED_FRACTION",
    "TABLE_PER_PARTITION",
    "SourceTable",
    "build_asset_from_spec",
    "build_llm_batch_asset",
]


@dataclass(frozen=True)
class SourceTable:
    """The input: table, its unique id column, the partition column and the prompt's columns.

    `columns` defaults to the columns the prompt names. A `table` whose last part is
    `{partition_key}` (e.g. "research.{partition_key}") reads one whole table per partition:
    the pattern for dynamic partitions added by the new-input-tables sensor.
    """

    table: str
    id_column: str = "id"
    partition_column: str | None = None
    columns: Sequence[str] = field(default_factory=tuple)


def _slice_for(
    context: dg.AssetExecutionContext, key: str | None, column: str | None, per_partition: bool
) -> SliceFilter:
    if key is None:
        return SliceFilter()
    if per_partition:
        return SliceFilter(label=key)
    if column is None:
        raise BatchLLMError(description="A partitioned asset needs source.partition_column.")
    pdef = context.assets_def.partitions_def
    if isinstance(pdef, dg.TimeWindowPartitionsDefinition):
        window = pdef.time_window_for_partition_key(key)
        return SliceFilter(column=column, start=window.start, end=window.end, label=key)
    return SliceFilter(column=column, value=key, label=key)


def build_llm_batch_asset(
    *,
    name: str,
    source: SourceTable,
    prompt: Prompt | str,
    output: str,
    model: str | None = None,
    params: Mapping[str, Any] | None = None,
    partitions_def: dg.PartitionsDefinition | None = None,
    max_failed_fraction: float = DEFAULT_MAX_FAILED_FRACTION,
    warn_failed_fraction: float = DEFAULT_WARN_FAILED_FRACTION,
    checks: bool = True,
    mode: str = "live",
    batch: BatchSettings | Mapping[str, Any] | None = None,
    output_schema: type[BaseModel] | Mapping[str, Any] | OutputSchema | None = None,
    repair_attempts: int = 1,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    render_timeout_s: float = DEFAULT_RENDER_TIMEOUT_S,
    max_prompt_chars: int | None = None,
    partitions_per_run: int | None = 1,
    warehouse_kind: str = "duckdb",
    provider: str | None = None,
    identity_endpoint: bool | None = None,
    pool: str | None = None,
    llm_resource_key: str = "llm",
    warehouse_resource_key: str = "warehouse",
    key_prefix: Sequence[str] | None = None,
    group_name: str | None = None,
    description: str | None = None,
    deps: Sequence[dg.AssetKey | str] | None = None,
    tags: Mapping[str, str] | None = None,
    owners: Sequence[str] | None = None,
) -> dg.AssetsDefinition:
    """An asset whose partitions each send one chat request per source row and write the answers.

    Every setting is validated by LlmBatchSpec before any run (identifiers, the template and the
    columns it names, ranges); an error names the setting ("source.table: Invalid table ...").
    Add `source_table_spec(asset)` to the Definitions to show the source table upstream.

    Rendering one row may take `render_timeout_s` and produce `max_prompt_chars` (None: 8 per
    token of the model's context window); past either the row fails without being sent.

    `mode="batch"` sends a partition's pending rows through the provider's Batch API (half
    price, completes within 24 h); `batch` says how (BatchSettings: wait, file limits, ...).

    `output_schema` (a pydantic model class, or a mapping field -> type as in YAML) asks for
    JSON matching it and writes each field to its own typed column; an answer that does not
    match is re-asked `repair_attempts` times with the error, then fails `invalid_output`.
    """
    if isinstance(prompt, str):
        prompt = Prompt(template=prompt)
    if isinstance(batch, BatchSettings):
        batch = dataclasses.asdict(batch)
    spec = LlmBatchSpec.parse(
        name=name,
        source={
            "table": source.table,
            "id_column": source.id_column,
            "partition_column": source.partition_column,
            "columns": list(source.columns),
        },
        prompt={"template": prompt.template, "system": prompt.system},
        output=output,
        model=model,
        params=dict(params or {}),
        max_failed_fraction=max_failed_fraction,
        warn_failed_fraction=warn_failed_fraction,
        checks=checks,
        mode=mode,
        batch=dict(batch) if batch is not None else None,
        output_schema=output_schema,
        repair_attempts=repair_attempts,
        chunk_rows=chunk_rows,
        render_timeout_s=render_timeout_s,
        max_prompt_chars=max_prompt_chars,
        partitions_per_run=partitions_per_run,
        warehouse_kind=warehouse_kind,
        provider=provider,
        identity_endpoint=identity_endpoint,
        pool=pool,
        llm_resource_key=llm_resource_key,
        warehouse_resource_key=warehouse_resource_key,
        key_prefix=list(key_prefix) if key_prefix else None,
        group_name=group_name,
        description=description,
        tags=dict(tags) if tags else None,
        owners=list(owners) if owners else None,
    )
    extra = [dg.AssetKey.from_user_string(d) if isinstance(d, str) else d for d in deps or []]
    return build_asset_from_spec(spec, partitions_def=partitions_def, extra_deps=extra)


def build_asset_from_spec(
    spec: LlmBatchSpec,
    *,
    partitions_def: dg.PartitionsDefinition | None = None,
    extra_deps: Sequence[dg.AssetKey] = (),
) -> dg.AssetsDefinition:
    """The asset of a validated spec (the Python builder and the YAML component both end here)."""
    src = spec.source
    columns = spec.columns
    with at("prompt"):
        compiled = CompiledPrompt(
            spec.prompt_obj,
            columns,
            render_timeout_s=spec.render_timeout_s,
            max_prompt_chars=spec.max_prompt_chars,
        )
    typed = spec.typed
    run_spec = RunSpec(
        source=SourceRef(src.table, src.id_column, columns, src.partition_column),
        output=output_table(spec.output, typed.columns() if typed else ()),
        prompt=compiled,
        model=spec.model,
        params=dict(spec.params),
        chunk_rows=spec.chunk_rows,
        output_schema=typed,
        repair_attempts=spec.repair_attempts,
        identity_endpoint=spec.identity_endpoint,
    )
    llm_key, warehouse_key, output = spec.llm_resource_key, spec.warehouse_resource_key, spec.output
    deps = [
        *(dg.AssetKey.from_user_string(d) for d in spec.deps or []),
        *extra_deps,
        source_key(spec),
    ]

    asset_key = dg.AssetKey([*(spec.key_prefix or []), spec.name])
    specs = (
        [
            *check_specs(asset_key, warn_failed_fraction=spec.warn_failed_fraction),
            *field_check_specs(asset_key, typed),  # typed outputs: NULL fraction per field
        ]
        if spec.checks
        else None
    )
    with warnings.catch_warnings():  # backfill_policy is a beta parameter: no noise per load
        warnings.simplefilter("ignore", dg.BetaWarning)
        asset = dg.asset(
            name=spec.name,
            key_prefix=list(spec.key_prefix) if spec.key_prefix else None,
            partitions_def=partitions_def or spec.partitions_def(),
            backfill_policy=spec.backfill_policy(),
            pool=spec.pool_name,
            required_resource_keys={llm_key, warehouse_key},
            group_name=spec.group_name,
            description=spec.description
            or f"LLM answers for every row of {src.table}, written to {output}.",
            deps=list(dict.fromkeys(deps)),
            tags=dict(spec.tags or {}),
            owners=list(spec.owners) if spec.owners else None,
            kinds=asset_kinds(spec),
            metadata=definition_metadata(spec),
            check_specs=specs,
        )

    def _asset(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        llm: LLMResource = getattr(context.resources, llm_key)
        warehouse: Warehouse = getattr(context.resources, warehouse_key)
        if not context.assets_def.partitions_def or len(context.partition_keys) == 1:
            key = context.partition_key if context.assets_def.partitions_def else None
            if spec.mode == "batch":  # the Batch API path (assets/batch_mode.py)
                return _run_batch_partition(context, key, llm, warehouse, run_spec, spec)
            metadata, results = _run_partition(context, key, llm, warehouse, run_spec, spec)
            return dg.MaterializeResult(metadata=metadata, check_results=results)
        return _run_range(context, llm, warehouse, run_spec, spec)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)
        return asset(_asset)


def _run_range(
    context: dg.AssetExecutionContext,
    llm: LLMResource,
    warehouse: Warehouse,
    run_spec: RunSpec,
    spec: LlmBatchSpec,
) -> dg.MaterializeResult:
    """Several partitions in one run (partitions_per_run > 1, or None for a whole range, as
    `dg launch --partition-range` needs). Each partition runs on its own and is observed with
    its own figures; the run's materialization carries their totals (Dagster records it for
    every partition of the range)."""
    done: list[dict[str, Any]] = []
    failed: list[str] = []
    last_results: list[dg.AssetCheckResult] = []
    for key in context.partition_keys:
        try:
            metadata, last_results = _run_partition(context, key, llm, warehouse, run_spec, spec)
        except dg.Failure as exc:
            context.log.error(f"partition {key}: {exc.description}")
            failed.append(key)
            continue
        context.log_event(dg.AssetObservation(context.asset_key, partition=key, metadata=metadata))
        done.append(metadata)
    if failed:
        raise dg.Failure(
            description=f"{len(failed)} of {len(context.partition_keys)} partitions failed: "
            f"{', '.join(failed[:10])}. Rerun them to retry only their failed rows."
        )
    # One materialization covers the range; its checks carry the last partition's figures (each
    # partition's own figures are in its observation).
    return dg.MaterializeResult(metadata=range_totals(done), check_results=last_results)


_SUMMED = {"run/cost_usd", "run/wall_s", "run/limiter_wait_s", "partition/cost_usd"}


def range_totals(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One materialization's metadata for several partitions: counts (and cost, time) summed,
    other figures at their worst (max), text from the last."""
    totals: dict[str, Any] = {"partitions_in_run": dg.MetadataValue.int(len(parts))}
    for md in parts:
        for key, value in md.items():
            prev = totals.get(key)
            if isinstance(value, dg.IntMetadataValue) and isinstance(prev, dg.IntMetadataValue):
                totals[key] = dg.MetadataValue.int(prev.value + value.value)
            elif isinstance(value, dg.FloatMetadataValue) and isinstance(
                prev, dg.FloatMetadataValue
            ):
                merged = (
                    prev.value + value.value if key in _SUMMED else max(prev.value, value.value)
                )
                totals[key] = dg.MetadataValue.float(merged)
            else:
                totals[key] = value
    return totals


def _partition_source(
    context: dg.AssetExecutionContext, key: str | None, run_spec: RunSpec, spec: LlmBatchSpec
) -> tuple[SliceFilter, str, RunSpec]:
    """The slice, partition key and run spec of one partition (a table per partition: its own)."""
    src = spec.source
    where = _slice_for(context, key, src.partition_column, src.per_partition)
    partition_key = key or "__all__"
    if src.per_partition:  # the partition names the table; checked like any table name
        table = src.table.replace(TABLE_PER_PARTITION, partition_key)
        check_table(table)
        run_spec = dataclasses.replace(
            run_spec, source=dataclasses.replace(run_spec.source, table=table)
        )
    return where, partition_key, run_spec


def _run_batch_partition(
    context: dg.AssetExecutionContext,
    key: str | None,
    llm: LLMResource,
    warehouse: Warehouse,
    run_spec: RunSpec,
    spec: LlmBatchSpec,
) -> dg.MaterializeResult:
    where, partition_key, run_spec = _partition_source(context, key, run_spec, spec)
    return materialize_batch_partition(
        context,
        run_spec,
        llm,
        warehouse,
        where,
        partition_key,
        settings=spec.batch_settings(),
        max_failed_fraction=spec.max_failed_fraction,
        checks=spec.checks,
        warn_failed_fraction=spec.warn_failed_fraction,
    )


def _run_partition(
    context: dg.AssetExecutionContext,
    key: str | None,
    llm: LLMResource,
    warehouse: Warehouse,
    run_spec: RunSpec,
    spec: LlmBatchSpec,
) -> tuple[dict[str, Any], list[dg.AssetCheckResult]]:
    """Run one partition (or the whole table): its materialisation metadata and check results,
    judged on the partition as the output table now holds it."""
    where, partition_key, run_spec = _partition_source(context, key, run_spec, spec)
    try:
        with warehouse.session() as session:
            run = PartitionRun(
                run_spec,
                llm,
                session,
                where,
                partition_key,
                context.log,
                warehouse.identity(),
                run_id=context.run_id,
            )
            stats = run.run()
            summary = session.partition_summary(spec.output, partition_key)
            typed = run_spec.output_schema
            quality = (
                field_quality(session, spec.output, partition_key, typed.names) if typed else {}
            )
    except BatchLLMError as exc:  # the engine's and warehouses' own errors, as Dagster's
        raise dg.Failure(description=exc.description, metadata=exc.metadata) from None
    metadata = build_metadata(stats, summary=summary, model=run.model, output=spec.output)
    metadata.update(quality_metadata(quality))  # typed outputs: NULL fraction per field
    if stats.aborted:
        context.log.warning(f"partition {partition_key}: sending stopped early: {stats.aborted}")
        metadata["run/stopped_sending"] = dg.MetadataValue.text(stats.aborted)
    if run.served_model and run.served_model != run.model:
        metadata["served_model"] = dg.MetadataValue.text(run.served_model)
    judge_partition(
        summary,
        stats.rows_in,
        max_failed_fraction=spec.max_failed_fraction,
        aborted=stats.aborted,
        metadata=metadata,
    )
    results = (
        [
            *check_results(summary, stats.rows_in, warn_failed_fraction=spec.warn_failed_fraction),
            *field_check_results(context.asset_key, quality, spec.warn_failed_fraction),
        ]
        if spec.checks
        else []
    )
    return metadata, results
