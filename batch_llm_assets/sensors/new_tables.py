"""A sensor that turns each new input table into a dynamic partition and a run."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass

import dagster as dg

from ..engine.errors import BatchLLMError
from ..warehouses.base import Warehouse, check_identifier

DEFAULT_MAX_TABLES_PER_TICK = 25
LISTING_LIMIT = 10_000


@dataclass
class _Cursor:
    """Small and typed: what the last tick saw. The partitions themselves are the memory."""

    v: int = 1
    tables_seen: int = 0
    last_added: str | None = None

    @classmethod
    def parse(cls, raw: str | None) -> _Cursor:
        try:
            return cls(**json.loads(raw)) if raw else cls()
        except (ValueError, TypeError):
            return cls()  # unreadable: start afresh; partitions and run keys prevent repeats


def build_new_input_tables_sensor(
    *,
    asset: dg.AssetsDefinition,
    dataset: str,
    table_pattern: str,
    name: str | None = None,
    warehouse_resource_key: str = "warehouse",
    minimum_interval_seconds: int = 60,
    max_tables_per_tick: int = DEFAULT_MAX_TABLES_PER_TICK,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.SensorDefinition:
    """Watch `dataset` for tables whose whole name matches `table_pattern` (a regex).

    Each new table becomes a partition of `asset` (which must use DynamicPartitionsDefinition,
    typically with source table "dataset.{partition_key}") and one run request keyed by the
    table, so a table is launched once even if the cursor is lost. At most
    `max_tables_per_tick` tables are added per tick; the rest wait for the next.
    """
    check_identifier(dataset, "dataset")
    try:
        pattern = re.compile(table_pattern)
    except re.error as exc:
        raise BatchLLMError(
            description=f"table_pattern {table_pattern!r} is not a valid regular expression: {exc}"
        ) from None
    partitions_def = asset.partitions_def
    if not isinstance(partitions_def, dg.DynamicPartitionsDefinition) or not partitions_def.name:
        raise BatchLLMError(
            description=f"Asset {asset.key.to_user_string()} must be partitioned by a named "
            "DynamicPartitionsDefinition for the new-input-tables sensor."
        )
    if max_tables_per_tick < 1:
        raise BatchLLMError(description="max_tables_per_tick must be >= 1")

    @dg.sensor(
        name=name or f"{asset.key.path[-1]}_new_input_tables",
        asset_selection=[asset.key],
        minimum_interval_seconds=minimum_interval_seconds,
        required_resource_keys={warehouse_resource_key},
        default_status=default_status,
        description=f"New tables in {dataset} matching /{table_pattern}/ become partitions of "
        f"{asset.key.to_user_string()} and runs.",
    )
    def _sensor(context: dg.SensorEvaluationContext, **resources: object):
        cursor = _Cursor.parse(context.cursor)
        warehouse: Warehouse = getattr(context.resources, warehouse_resource_key)
        try:
            with warehouse.session() as session:
                tables = session.list_tables(dataset, LISTING_LIMIT)
        except BatchLLMError as exc:
            context.log.error(str(exc.description))
            return dg.SkipReason(f"Cannot list dataset {dataset!r}: {exc.description}")
        matching = [t for t in tables if pattern.fullmatch(t)]
        known = set(context.instance.get_dynamic_partitions(partitions_def.name))
        new = sorted(t for t in matching if t not in known)[:max_tables_per_tick]
        cursor.tables_seen = len(matching)
        if not new:
            return dg.SensorResult(
                skip_reason=f"No new tables among {len(matching)} matching in {dataset}.",
                cursor=json.dumps(asdict(cursor)),
            )
        cursor.last_added = new[-1]
        return dg.SensorResult(
            run_requests=[dg.RunRequest(run_key=f"table:{t}", partition_key=t) for t in new],
            dynamic_partitions_requests=[partitions_def.build_add_request(new)],
            cursor=json.dumps(asdict(cursor)),
        )

    return _sensor
