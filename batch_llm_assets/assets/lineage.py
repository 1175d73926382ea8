"""What the asset graph shows: the source table upstream, kinds, table names, typed columns.

The warehouse resource is not known when definitions load, so its kind comes from the spec's
`warehouse_kind`; the provider's kind from `provider` (default openai).
"""

from __future__ import annotations

import warnings
from typing import Any

import dagster as dg

from ..warehouses import bigquery_types, duckdb_types
from .schema import OUTPUT_COLUMNS, output_schema
from .spec import TABLE_PER_PARTITION, LlmBatchSpec
from .structured import column_schema as typed_column_schema

# Logical output types as each warehouse names them: the tables' own types.
WAREHOUSE_TYPES = {"duckdb": duckdb_types.TYPES, "bigquery": bigquery_types.TYPES}
SOURCE_TABLE_KEY = "batch_llm/source_table"
SOURCE_TYPES_KEY = "batch_llm/source_column_types"


def source_key(spec: LlmBatchSpec) -> dg.AssetKey:
    """The source table as an asset key: its dotted parts. A table per partition
    ('incoming.{partition_key}') is one partitioned source: its dataset."""
    return _source_key(spec.source.table, spec.name)


def _source_key(table: str, asset_name: str) -> dg.AssetKey:
    parts = table.split(".")
    if table.endswith(TABLE_PER_PARTITION):
        parts = parts[:-1] or [f"{asset_name}_source_tables"]
    return dg.AssetKey(parts)


def source_table_spec(asset: dg.AssetsDefinition) -> dg.AssetSpec:
    """The external asset for the source table of a batch asset, upstream of it in the graph.
    Its partitions are the asset's when each partition reads its own table."""
    md = asset.specs_by_key[asset.key].metadata
    table, per_partition = str(md[SOURCE_TABLE_KEY]), bool(md["batch_llm/table_per_partition"])
    kind = str(md["batch_llm/warehouse_kind"])
    return dg.AssetSpec(
        key=_source_key(table, asset.key.path[-1]),
        description=(
            f"One {kind} table per partition: {table}."
            if per_partition
            else f"The {kind} table {table}, read by {asset.key.to_user_string()}."
        ),
        kinds={kind},
        group_name=asset.group_names_by_key.get(asset.key),
        partitions_def=asset.partitions_def if per_partition else None,
        metadata={
            "dagster/table_name": table.replace(TABLE_PER_PARTITION, "<partition_key>"),
            **_source_schema(md.get(SOURCE_TYPES_KEY)),
        },
    )


def _source_schema(types: Any) -> dict[str, Any]:
    """The source's column schema, when the spec declares its column types."""
    data = getattr(types, "data", types) or {}
    if not data:
        return {}
    cols = [dg.TableColumn(name, str(kind)) for name, kind in data.items()]
    return {"dagster/column_schema": dg.TableSchema(columns=cols)}


def asset_kinds(spec: LlmBatchSpec) -> set[str]:
    return {spec.warehouse_kind, spec.provider_kind, "python"}


def column_schema(spec: LlmBatchSpec) -> dg.TableSchema:
    """The output columns typed as the warehouse names them (the id keeps the source's type)."""
    types = {c: WAREHOUSE_TYPES[spec.warehouse_kind][t] for c, t in OUTPUT_COLUMNS}
    src = spec.source
    declared = {k.lower(): v for k, v in src.column_types.items()}
    if src.id_column.lower() in declared:  # the id keeps the source's type, when declared
        types[src.id_column] = declared[src.id_column.lower()]
    cols = [
        dg.TableColumn(
            c.name,
            types.get(c.name, f"type of {src.table}.{src.id_column}"),
            description=c.description,
        )
        for c in output_schema(src.id_column).columns
    ]
    return typed_column_schema(dg.TableSchema(columns=cols), spec.typed)


def definition_metadata(spec: LlmBatchSpec) -> dict[str, Any]:
    """What is known when definitions load; the resolved model is recorded per materialization."""
    md: dict[str, Any] = {
        "dagster/table_name": spec.output,
        "dagster/column_schema": column_schema(spec),
        SOURCE_TABLE_KEY: spec.source.table,
        "batch_llm/table_per_partition": spec.source.per_partition,
        "batch_llm/output_table": spec.output,
        "batch_llm/prompt_template": spec.prompt.template,
        "batch_llm/pool": spec.pool_name,
        "batch_llm/warehouse_kind": spec.warehouse_kind,
        "batch_llm/mode": spec.mode,
    }
    if spec.source.column_types:
        md[SOURCE_TYPES_KEY] = dg.MetadataValue.json(dict(spec.source.column_types))
    if spec.prompt.system is not None:
        md["batch_llm/system_prompt"] = spec.prompt.system
    if spec.model is not None:  # else the resource's: recorded on each materialization
        md["batch_llm/model"] = spec.model
    if spec.params:
        md["batch_llm/params"] = dg.MetadataValue.json(dict(spec.params))
    return md


def limits_metadata(llm: Any, pool: str | None = None) -> dict[str, Any]:
    """The LLM resource's limits as definition metadata (the resource is bound after the asset
    is built, so the code location adds these: `with_limits_metadata`)."""
    md: dict[str, Any] = {
        "batch_llm/rpm": llm.rpm if llm.rpm is not None else "not set",
        "batch_llm/tpm": llm.tpm if llm.tpm is not None else "not set",
        "batch_llm/resource_model": llm.model,
    }
    if pool is not None:
        md["batch_llm/pool"] = pool
    return md


def with_limits_metadata(
    defs: dg.Definitions, llm: Any, selection: dg.AssetSelection | None = None
) -> dg.Definitions:
    """`defs` with the resource's rpm, tpm and model on every batch asset's definition."""

    def add(asset_spec: dg.AssetSpec) -> dg.AssetSpec:
        if SOURCE_TABLE_KEY not in asset_spec.metadata:  # not a batch asset
            return asset_spec
        return asset_spec.merge_attributes(metadata=limits_metadata(llm))

    with warnings.catch_warnings():  # map_asset_specs is a preview API: no noise per load
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return defs.map_asset_specs(func=add, selection=selection)
