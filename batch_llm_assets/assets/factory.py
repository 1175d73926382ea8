"""build_llm_batch_asset: a partitioned asset that runs an LLM over every row of a table slice."""

import dataclasses
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
from pydantic import BaseModel

from ..resources.llm import LLMResource
from ..warehouses.base import SourceRef, Warehouse
from .batch_mode import BatchSettings
from .batch_results import materialize_batch_partition
from .checks import DEFAULT_WARN_FAILED_FRACTION, check_specs
from .lineage import asset_kinds, definition_metadata, source_key
from .partitions import partition_source, run_partition
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
from .structured import OutputSchema, field_check_specs

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "DEFAULT_MAX_FAILED_FRACTION",
    "TABLE_PER_PARTITION",
    "SourceTable",
    "Task",
    "build_asset_from_spec",
    "build_llm_batch_asset",
    "run_spec_for",
    "spec_of",
]

# The spec of each asset built here, by its op (see spec_of).
_SPECS: weakref.WeakKeyDictionary[dg.OpDefinition, LlmBatchSpec] = weakref.WeakKeyDictionary()


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
    column_types: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    """What an asset's partitions run when not chat answers: the run spec, the live and the
    batch partition runs, and the definition's metadata."""

    run_spec: RunSpec
    run_class: type[PartitionRun]
    batch_run_class: type
    metadata: Mapping[str, Any]


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
    reuse_answers: bool | None = None,
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

    Rows whose request is identical (the same `request_hash`) are sent once per partition run;
    `reuse_answers` (default: when temperature is 0) also reuses answers stored in other
    partitions and earlier runs. Shared rows cost 0 and name their source in `shared_from`.

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
            "column_types": dict(source.column_types),
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
        reuse_answers=reuse_answers,
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
    task: Task | None = None,
) -> dg.AssetsDefinition:
    """The asset of a validated spec (the Python builder and the YAML component both end here).
    `task`: what its partitions run, when not chat answers (embeddings/factory.py)."""
    run_spec = task.run_spec if task is not None else run_spec_for(spec)
    typed = run_spec.output_schema
    llm_key, warehouse_key = spec.llm_resource_key, spec.warehouse_resource_key
    asset_key = dg.AssetKey([*(spec.key_prefix or []), spec.name])
    pdef = partitions_def or spec.partitions_def()
    # backfill_policy is a beta parameter, partitioned checks a preview: no noise per load.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)
        warnings.simplefilter("ignore", dg.PreviewWarning)
        specs = (
            [  # partitioned checks: one evaluation per partition, each showing its partition
                *check_specs(
                    asset_key, warn_failed_fraction=spec.warn_failed_fraction, partitions_def=pdef
                ),
                *field_check_specs(asset_key, typed, pdef),  # typed outputs: NULL per field
            ]
            if spec.checks
            else None
        )
        # A multi_asset of one asset, subsettable: each partition's materialization and
        # check evaluations are events with their own figures and partition
        # (assets/partitions.py). The step's output would record the same metadata on every
        # partition of a range, and required check outputs would take one result per step.
        asset = dg.multi_asset(
            name=asset_key.to_python_identifier(),
            specs=[_asset_spec(spec, asset_key, extra_deps, task)],
            partitions_def=pdef,
            backfill_policy=spec.backfill_policy(),
            pool=spec.pool_name,
            required_resource_keys={llm_key, warehouse_key},
            check_specs=specs,
            can_subset=True,
        )

    def _asset(context: dg.AssetExecutionContext) -> Iterator[Any]:
        llm: LLMResource = getattr(context.resources, llm_key)
        warehouse: Warehouse = getattr(context.resources, warehouse_key)
        partitioned = context.assets_def.partitions_def is not None
        if spec.mode == "batch" and (not partitioned or len(context.partition_keys) == 1):
            key = context.partition_key if partitioned else None
            # the Batch API path (assets/batch_mode.py)
            yield _run_batch_partition(context, key, llm, warehouse, run_spec, spec, task)
            return
        yield from _run_partitions(context, llm, warehouse, run_spec, spec, task)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.BetaWarning)
        built = asset(_asset)
    if task is None:  # what the estimate reads: chat answers only
        _SPECS[built.node_def] = spec
    return built


def _asset_spec(
    spec: LlmBatchSpec,
    asset_key: dg.AssetKey,
    extra_deps: Sequence[dg.AssetKey],
    task: Task | None,
) -> dg.AssetSpec:
    deps = [
        *(dg.AssetKey.from_user_string(d) for d in spec.deps or []),
        *extra_deps,
        source_key(spec),
    ]
    return dg.AssetSpec(
        asset_key,
        skippable=True,
        group_name=spec.group_name,
        description=spec.description
        or f"LLM answers for every row of {spec.source.table}, written to {spec.output}.",
        deps=list(dict.fromkeys(deps)),
        tags=dict(spec.tags or {}),
        owners=list(spec.owners) if spec.owners else None,
        kinds=asset_kinds(spec),
        metadata=dict(task.metadata) if task is not None else definition_metadata(spec),
    )


def run_spec_for(spec: LlmBatchSpec) -> RunSpec:
    """What a partition run of `spec` reads, renders, sends and writes."""
    src = spec.source
    with at("prompt"):
        compiled = CompiledPrompt(
            spec.prompt_obj,
            spec.columns,
            render_timeout_s=spec.render_timeout_s,
            max_prompt_chars=spec.max_prompt_chars,
        )
    typed = spec.typed
    return RunSpec(
        source=SourceRef(src.table, src.id_column, spec.columns, src.partition_column),
        output=output_table(spec.output, typed.columns() if typed else ()),
        prompt=compiled,
        model=spec.model,
        params=dict(spec.params),
        chunk_rows=spec.chunk_rows,
        output_schema=typed,
        repair_attempts=spec.repair_attempts,
        identity_endpoint=spec.identity_endpoint,
        reuse_answers=spec.reuse_answers,
    )


def spec_of(asset: dg.AssetsDefinition) -> LlmBatchSpec | None:
    """The spec `asset` was built from, or None for an asset this package did not build. Its
    op is the key: Dagster keeps it through subsetting and `map_asset_specs`."""
    return _SPECS.get(asset.node_def) if asset.is_executable else None


def _run_partitions(
    context: dg.AssetExecutionContext,
    llm: LLMResource,
    warehouse: Warehouse,
    run_spec: RunSpec,
    spec: LlmBatchSpec,
    task: Task | None = None,
) -> Iterator[Any]:
    """Each partition of the run (one, or a range: partitions_per_run > 1, or None as
    `dg launch --partition-range` needs) runs on its own and records its own materialization
    and checks. A bad partition does not take the good ones of the same run down with it:
    they are materialized as they finish; the step fails at the end, naming the bad ones."""
    keys = list(context.partition_keys) if context.assets_def.partitions_def else [None]
    failed: list[str] = []
    for key in keys:
        try:
            run_class = task.run_class if task is not None else PartitionRun
            outcome = run_partition(context, key, llm, warehouse, run_spec, spec, run_class)
        except dg.Failure as exc:  # could not run: nothing to judge, no checks
            if len(keys) == 1:
                raise
            context.log.error(f"partition {key}: {exc.description}")
            failed.append(f"{key}: {exc.description}")
            continue
        yield from outcome.events(context.asset_key)
        if outcome.failure is None:
            continue
        if len(keys) == 1:
            raise dg.Failure(description=outcome.failure, metadata=outcome.metadata)
        context.log.error(outcome.failure)
        failed.append(outcome.failure)
    if failed:
        raise dg.Failure(
            description=f"{len(failed)} of {len(keys)} partitions failed; the others are "
            f"materialized. {' | '.join(failed[:5])}"
        )


def _run_batch_partition(
    context: dg.AssetExecutionContext,
    key: str | None,
    llm: LLMResource,
    warehouse: Warehouse,
    run_spec: RunSpec,
    spec: LlmBatchSpec,
    task: Task | None = None,
) -> dg.MaterializeResult:
    pdef = context.assets_def.partitions_def
    where, partition_key, run_spec = partition_source(pdef, key, run_spec, spec)
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
        run_class=task.batch_run_class if task is not None else None,
    )
