"""One partition's run as Dagster events: its own materialization and check evaluations.

Each partition of a run, alone or one of a range, records a materialization carrying its own
figures (`partition=` set explicitly), so the Partitions tab and the plots are right whatever
the run's shape. A partition over max_failed_fraction records no materialization (it shows
failed) but still records its check evaluations; the others of the same run stay materialized.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import dagster as dg

from ..engine.errors import BatchLLMError
from ..resources.llm import LLMResource
from ..warehouses.base import SliceFilter, Warehouse, check_table
from .checks import PartitionOutcome, check_results, failure_reason
from .metadata import Limits, RunStats, build_metadata
from .pipeline import PartitionRun, RunSpec
from .pricing import check_flex, pricing_label
from .spec import TABLE_PER_PARTITION, LlmBatchSpec
from .structured import field_check_results, field_quality, quality_metadata


def slice_for(
    pdef: dg.PartitionsDefinition | None, key: str | None, column: str | None, per_partition: bool
) -> SliceFilter:
    if key is None:
        return SliceFilter()
    if per_partition:
        return SliceFilter(label=key)
    if column is None:
        raise BatchLLMError(description="A partitioned asset needs source.partition_column.")
    if isinstance(pdef, dg.TimeWindowPartitionsDefinition):
        window = pdef.time_window_for_partition_key(key)
        return SliceFilter(column=column, start=window.start, end=window.end, label=key)
    return SliceFilter(column=column, value=key, label=key)


def partition_source(
    pdef: dg.PartitionsDefinition | None, key: str | None, run_spec: RunSpec, spec: LlmBatchSpec
) -> tuple[SliceFilter, str, RunSpec]:
    """The slice, partition key and run spec of one partition of an asset partitioned by `pdef`
    (a table per partition: its own)."""
    src = spec.source
    where = slice_for(pdef, key, src.partition_column, src.per_partition)
    partition_key = key or "__all__"
    if src.per_partition:  # the partition names the table; checked like any table name
        table = src.table.replace(TABLE_PER_PARTITION, partition_key)
        check_table(table)
        run_spec = dataclasses.replace(
            run_spec, source=dataclasses.replace(run_spec.source, table=table)
        )
    return where, partition_key, run_spec


def run_partition(
    context: dg.AssetExecutionContext,
    key: str | None,
    llm: LLMResource,
    warehouse: Warehouse,
    run_spec: RunSpec,
    spec: LlmBatchSpec,
    run_class: type[PartitionRun] = PartitionRun,
) -> PartitionOutcome:
    """Run one partition (or the whole table) with `run_class`, judged on the partition as the
    output table now holds it. Raises dg.Failure only when it could not run (nothing to judge)."""
    pdef = context.assets_def.partitions_def
    where, partition_key, run_spec = partition_source(pdef, key, run_spec, spec)
    try:
        check_flex(llm, run_spec.model or llm.model, {**llm.params, **run_spec.params}, context.log)
        with warehouse.session() as session:
            run = run_class(
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
    metadata = build_metadata(
        stats,
        summary=summary,
        model=run.model,
        output=spec.output,
        partition_key=partition_key,
        limits=Limits(rpm=llm.rpm, tpm=llm.tpm),
        pricing=pricing_label(run.price),
    )
    metadata.update(quality_metadata(quality))  # typed outputs: NULL fraction per field
    if stats.aborted:
        context.log.warning(f"partition {partition_key}: sending stopped early: {stats.aborted}")
        metadata["run/stopped_sending"] = dg.MetadataValue.text(stats.aborted)
    if run.served_model and run.served_model != run.model:
        metadata["served_model"] = dg.MetadataValue.text(run.served_model)
    why = _verdict(summary, stats, spec, partition_key)
    checks = (
        [
            *check_results(summary, stats.rows_in, warn_failed_fraction=spec.warn_failed_fraction),
            *field_check_results(context.asset_key, quality, spec.warn_failed_fraction),
        ]
        if spec.checks
        else []
    )
    return PartitionOutcome(key, metadata, checks, why)


def _verdict(summary: dict[str, Any], stats: RunStats, spec: LlmBatchSpec, key: str) -> str | None:
    """Why the partition fails (too many failed rows in the output table, a spend cap), or None."""
    why = failure_reason(
        summary,
        stats.rows_in,
        max_failed_fraction=spec.max_failed_fraction,
        aborted=stats.aborted,
        budget=stats.budget_stop,
    )
    if why is None:
        return None
    top = ", ".join(f"{k} ({n})" for k, n in summary["errors"].items()) or "none"
    return (
        f"partition {key}: {why}. Top errors in the partition: {top}. Every row was written; "
        "rerun the partition to retry only the failed rows."
    )
