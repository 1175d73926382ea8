"""build_llm_batch_asset: a partitioned asset that runs an LLM over every row of a table slice."""

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
from pydantic import BaseModel

from ..engine.errors import BatchLLMError
from ..resources.llm import LLMResource
from ..warehouses.base import SliceFilter, SourceRef, Warehouse, check_identifier, check_table
from .metadata import build_metadata
from .prompt import CompiledPrompt, Prompt
from .runner import PartitionRun, RunSpec, check_failures
from .schema import OUTPUT_COLUMNS, output_table
from .schema import output_schema as output_schema_of
from .structured import (
    OutputSchema,
    column_schema,
    field_check_results,
    field_check_specs,
    field_quality,
    parse_output_schema,
    quality_metadata,
)

DEFAULT_MAX_FAILED_FRACTION = 0.05
DEFAULT_CHUNK_ROWS = 1000


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


TABLE_PER_PARTITION = "{partition_key}"


def _slice_for(
    context: dg.AssetExecutionContext, column: str | None, per_partition: bool
) -> tuple[SliceFilter, str]:
    if not context.has_partition_key:
        return SliceFilter(), "__all__"
    key = context.partition_key
    if per_partition:
        return SliceFilter(label=key), key
    if column is None:
        raise BatchLLMError(description="A partitioned asset needs source.partition_column.")
    if isinstance(context.assets_def.partitions_def, dg.TimeWindowPartitionsDefinition):
        window = context.partition_time_window
        return SliceFilter(column=column, start=window.start, end=window.end, label=key), key
    return SliceFilter(column=column, value=key, label=key), key


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
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    llm_resource_key: str = "llm",
    warehouse_resource_key: str = "warehouse",
    key_prefix: Sequence[str] | None = None,
    group_name: str | None = None,
    description: str | None = None,
    deps: Sequence[dg.AssetKey | str] | None = None,
    tags: Mapping[str, str] | None = None,
    owners: Sequence[str] | None = None,
    output_schema: type[BaseModel] | Mapping[str, Any] | OutputSchema | None = None,
    repair_attempts: int = 1,
) -> dg.AssetsDefinition:
    """An asset whose partitions each send one chat request per source row and write the answers.

    Checked here, before any run: identifiers (names only, never SQL), the template's syntax and
    that it names only known columns, and the settings' ranges.

    `output_schema` (a pydantic model class, or a mapping field -> type as in YAML) asks for
    JSON matching it and writes each field to its own typed column; an answer that does not
    match is re-asked `repair_attempts` times with the error, then fails `invalid_output`.
    """
    check_identifier(name, "asset")
    per_partition = source.table.endswith(TABLE_PER_PARTITION)
    check_table(source.table.replace(TABLE_PER_PARTITION, "t"))
    check_table(output)
    check_identifier(source.id_column, "id column")
    if source.partition_column is not None:
        check_identifier(source.partition_column, "partition column")
    if isinstance(prompt, str):
        prompt = Prompt(template=prompt)
    columns = tuple(source.columns) or tuple(sorted(prompt.variables()))
    for column in columns:
        check_identifier(column)
    compiled = CompiledPrompt(prompt, columns)
    if not 0 <= max_failed_fraction <= 1:
        raise BatchLLMError(
            description=f"max_failed_fraction must be within [0, 1], got {max_failed_fraction}"
        )
    if chunk_rows < 1:
        raise BatchLLMError(description=f"chunk_rows must be >= 1, got {chunk_rows}")
    if partitions_def is None:
        partitions_def = dg.DailyPartitionsDefinition(start_date="2019-01-01")
    if source.partition_column is None and not per_partition:
        raise BatchLLMError(
            description=f"Asset {name!r} is partitioned: set source.partition_column."
        )
    params = dict(params or {})
    typed = parse_output_schema(output_schema, reserved=[c for c, _ in OUTPUT_COLUMNS])
    if typed is not None and "response_format" in params:
        raise BatchLLMError(
            description="params.response_format and output_schema are both set: output_schema "
            "decides the answer's format (and how the provider is asked for it); drop "
            "response_format."
        )
    if repair_attempts < 0:
        raise BatchLLMError(description=f"repair_attempts must be >= 0, got {repair_attempts}")
    spec = RunSpec(
        source=SourceRef(source.table, source.id_column, columns, source.partition_column),
        output=output_table(output, typed.columns() if typed else ()),
        prompt=compiled,
        model=model,
        params=params,
        chunk_rows=chunk_rows,
        output_schema=typed,
        repair_attempts=repair_attempts,
    )

    key = dg.AssetKey([*(key_prefix or []), name])

    @dg.asset(
        name=name,
        key_prefix=list(key_prefix) if key_prefix else None,
        partitions_def=partitions_def,
        required_resource_keys={llm_resource_key, warehouse_resource_key},
        group_name=group_name,
        description=description
        or f"LLM answers for every row of {source.table}, written to {output}.",
        deps=list(deps or []),
        tags=dict(tags or {}),
        owners=list(owners) if owners else None,
        kinds={"python", "openai"},
        check_specs=field_check_specs(key, typed),  # typed outputs: NULL fraction per field
        metadata={
            "batch_llm/source_table": source.table,
            "batch_llm/table_per_partition": per_partition,
            "batch_llm/output_table": output,
            "batch_llm/prompt_template": prompt.template,
            "batch_llm/model": model or "(resource default)",
            "dagster/column_schema": column_schema(output_schema_of(source.id_column), typed),
        },
    )
    def _asset(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        llm: LLMResource = getattr(context.resources, llm_resource_key)
        warehouse: Warehouse = getattr(context.resources, warehouse_resource_key)
        where, partition_key = _slice_for(context, source.partition_column, per_partition)
        run_spec = spec
        if per_partition:  # the partition names the table; checked like any table name
            table = source.table.replace(TABLE_PER_PARTITION, partition_key)
            check_table(table)
            run_spec = dataclasses.replace(
                spec, source=dataclasses.replace(spec.source, table=table)
            )
        try:
            with warehouse.session() as session:
                run = PartitionRun(
                    run_spec, llm, session, where, partition_key, context.log, warehouse.identity()
                )
                stats = run.run()
                row_count = session.count_output(output, partition_key)
                quality = (
                    field_quality(session, output, partition_key, typed.names) if typed else {}
                )
        except BatchLLMError as exc:  # the engine's and warehouses' own errors, as Dagster's
            raise dg.Failure(description=exc.description, metadata=exc.metadata) from None
        metadata = build_metadata(stats, row_count=row_count, model=run.model, output=output)
        metadata.update(quality_metadata(quality))  # typed outputs: NULL fraction per field
        check_failures(stats, max_failed_fraction, metadata)
        checks = field_check_results(key, quality, max_failed_fraction)
        return dg.MaterializeResult(metadata=metadata, check_results=checks)

    return _asset
