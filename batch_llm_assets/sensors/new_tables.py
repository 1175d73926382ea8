"""A sensor that turns each new input table into a dynamic partition and a run."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

import dagster as dg

from ..engine.errors import BatchLLMError
from ..warehouses.base import InvalidIdentifierError, Warehouse, check_identifier

DEFAULT_MAX_TABLES_PER_TICK = 25
DEFAULT_TABLES_PER_PAGE = 1000
# Unreadable table names the cursor remembers, so each is warned about once, not every tick.
UNREADABLE_REMEMBERED = 200


@dataclass
class _Cursor:
    """Small and typed: where the current sweep of the listing stands. A sweep reads the
    dataset's tables in name order, one page per tick, then starts over; the partitions
    themselves remember which tables were launched."""

    v: int = 2
    after: str | None = None  # last table name examined in this sweep; None: from the first
    tables_seen: int = 0  # matching tables seen so far in this sweep
    sweeps: int = 0  # sweeps completed
    last_added: str | None = None
    # Matching tables whose names a run could not read, already warned about (the latest few).
    unreadable: list[str] = field(default_factory=list)
    # Why the dataset could not be listed, already warned about (cleared once it lists again).
    listing_error: str | None = None

    @classmethod
    def parse(cls, raw: str | None) -> _Cursor:
        try:
            cursor = cls(**json.loads(raw)) if raw else cls()
        except (ValueError, TypeError):
            return cls()  # unreadable: start afresh; partitions and run keys prevent repeats
        return cursor if cursor.v == cls.v else cls()


def build_new_input_tables_sensor(
    *,
    asset: dg.AssetsDefinition,
    dataset: str,
    table_pattern: str,
    name: str | None = None,
    warehouse_resource_key: str = "warehouse",
    minimum_interval_seconds: int = 60,
    max_tables_per_tick: int = DEFAULT_MAX_TABLES_PER_TICK,
    tables_per_page: int = DEFAULT_TABLES_PER_PAGE,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.SensorDefinition:
    """Watch `dataset` for tables whose whole name matches `table_pattern` (a regex).

    Each new table becomes a partition of `asset` (which must use DynamicPartitionsDefinition,
    typically with source table "dataset.{partition_key}") and one run request keyed by the
    table, so a table is launched once even if the cursor is lost. Work per tick is bounded
    whatever the dataset holds: one page of `tables_per_page` names (read after the cursor's
    position, so a sweep covers any number of tables over successive ticks) and at most
    `max_tables_per_tick` new partitions; the rest wait for the next tick.
    """
    pattern, partitions_def = _checked(
        asset, dataset, table_pattern, max_tables_per_tick, tables_per_page
    )

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
        if cursor.after is None:
            cursor.tables_seen = 0
        warehouse: Warehouse = getattr(context.resources, warehouse_resource_key)
        page = _list_page(context, cursor, warehouse, dataset, tables_per_page)
        if isinstance(page, dg.SensorResult):
            return page
        new = _new_tables(
            context,
            cursor,
            page,
            dataset=dataset,
            pattern=pattern,
            partitions_name=partitions_def.name or "",
            limit=max_tables_per_tick,
            page_size=tables_per_page,
        )
        return _tick_result(cursor, new, dataset, partitions_def)

    return _sensor


def _checked(
    asset: dg.AssetsDefinition,
    dataset: str,
    table_pattern: str,
    max_tables_per_tick: int,
    tables_per_page: int,
) -> tuple[re.Pattern[str], dg.DynamicPartitionsDefinition]:
    """The builder's arguments checked: the compiled pattern and the asset's partitions."""
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
    if tables_per_page < 1:
        raise BatchLLMError(description="tables_per_page must be >= 1")
    return pattern, partitions_def


def _list_page(
    context: dg.SensorEvaluationContext,
    cursor: _Cursor,
    warehouse: Warehouse,
    dataset: str,
    tables_per_page: int,
) -> list[str] | dg.SensorResult:
    """The next page of the listing, or the tick's result when the dataset cannot be listed."""
    try:
        with warehouse.session() as session:
            page = session.list_tables_page(dataset, cursor.after, tables_per_page)
    except BatchLLMError as exc:
        # A missing dataset is a state the sensor waits out (it may be created later), not
        # an error of each tick: warned once, until it lists again.
        if exc.description != cursor.listing_error:
            context.log.warning(str(exc.description))
            cursor.listing_error = str(exc.description)
        return dg.SensorResult(
            skip_reason=f"Cannot list dataset {dataset!r}: {exc.description}",
            cursor=json.dumps(asdict(cursor)),
        )
    cursor.listing_error = None
    return page


def _new_tables(
    context: dg.SensorEvaluationContext,
    cursor: _Cursor,
    page: list[str],
    *,
    dataset: str,
    pattern: re.Pattern[str],
    partitions_name: str,
    limit: int,
    page_size: int,
) -> list[str]:
    """The page's tables that match, can be read and are no partition yet (at most `limit`);
    the cursor moves past those examined, or back to the start once the listing is done."""
    new: list[str] = []
    examined = 0
    for table in page:
        examined += 1
        if not pattern.fullmatch(table):
            continue
        if not _readable(context, cursor, dataset, table):
            continue
        cursor.tables_seen += 1
        if not context.instance.has_dynamic_partition(partitions_name, table):
            new.append(table)
            if len(new) >= limit:
                break
    if examined == len(page) and len(page) < page_size:
        cursor.after, cursor.sweeps = None, cursor.sweeps + 1  # listing done: start over
    else:
        cursor.after = page[examined - 1]
    return new


def _tick_result(
    cursor: _Cursor, new: list[str], dataset: str, partitions_def: dg.DynamicPartitionsDefinition
) -> dg.SensorResult:
    """A partition and a run per new table, or a skip saying how far the sweep got."""
    if not new:
        return dg.SensorResult(
            skip_reason=f"No new tables among {cursor.tables_seen} matching in {dataset} "
            "so far in this sweep.",
            cursor=json.dumps(asdict(cursor)),
        )
    cursor.last_added = new[-1]
    return dg.SensorResult(
        run_requests=[dg.RunRequest(run_key=f"table:{t}", partition_key=t) for t in new],
        dynamic_partitions_requests=[partitions_def.build_add_request(new)],
        cursor=json.dumps(asdict(cursor)),
    )


def _readable(
    context: dg.SensorEvaluationContext, cursor: _Cursor, dataset: str, table: str
) -> bool:
    """Whether a run could read `table` by its name (the names a run accepts: letters, digits,
    underscores). Another name would make a partition whose every run fails: it is skipped, with
    one warning per table."""
    try:
        check_identifier(table, "table")
    except InvalidIdentifierError as exc:
        if table not in cursor.unreadable:
            context.log.warning(
                f"Skipped table {table!r} of {dataset}: no run could read it. {exc.description}"
            )
            cursor.unreadable = [*cursor.unreadable, table][-UNREADABLE_REMEMBERED:]
        return False
    return True
