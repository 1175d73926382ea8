"""The new-input-tables sensor, evaluated with Dagster's own test contexts: new tables become
partitions and runs exactly once, sweeps in bounded pages, unreadable table names skipped with
one warning, clear errors. Schedules, run notifications and asset checks are in
test_schedules_notifications_checks.py."""

from __future__ import annotations

import json
import logging

import dagster as dg
import duckdb
import pytest

from batch_llm_assets import (
    DuckDBWarehouse,
    LLMResource,
    Prompt,
    SourceTable,
    build_llm_batch_asset,
)
from batch_llm_assets.engine.errors import BatchLLMError
from batch_llm_assets.sensors import build_new_input_tables_sensor

from .conftest import SIM_KEY

TABLES = dg.DynamicPartitionsDefinition(name="input_tables")


def table_asset(**kw):
    return build_llm_batch_asset(
        name="incoming_sentiment",
        source=SourceTable(table="incoming.{partition_key}", columns=["headline"]),
        prompt=Prompt(template="{{ headline }} Answer with one of: up, down"),
        output="incoming_sentiment",
        partitions_def=TABLES,
        **kw,
    )


@pytest.fixture
def incoming(tmp_path):
    path = str(tmp_path / "in.duckdb")
    con = duckdb.connect(path)
    con.execute("CREATE SCHEMA incoming")
    for name in ("headlines_20261101", "headlines_20261102", "notes"):
        con.execute(
            f"CREATE TABLE incoming.{name} AS SELECT range + 1 AS id, "
            "'headline ' || range AS headline FROM range(5)"
        )
    con.close()
    return path


def tick(sensor, instance, db, cursor=None):
    resources = {"warehouse": DuckDBWarehouse(database=db), "llm": LLMResource()}
    defs = dg.Definitions(assets=[table_asset()], sensors=[sensor], resources=resources)
    with dg.build_sensor_context(
        instance=instance, cursor=cursor, resources=resources, definitions=defs
    ) as ctx:
        return sensor(ctx)


def test_new_tables_become_partitions_and_runs_exactly_once(incoming):
    asset = table_asset()
    sensor = build_new_input_tables_sensor(
        asset=asset, dataset="incoming", table_pattern=r"headlines_\d{8}", max_tables_per_tick=1
    )
    with dg.instance_for_test() as instance:
        first = tick(sensor, instance, incoming)
        assert [r.partition_key for r in first.run_requests] == ["headlines_20261101"]
        assert first.dynamic_partitions_requests[0].partition_keys == ["headlines_20261101"]
        instance.add_dynamic_partitions("input_tables", ["headlines_20261101"])  # as the daemon
        second = tick(sensor, instance, incoming, cursor=first.cursor)
        assert [r.partition_key for r in second.run_requests] == ["headlines_20261102"]
        instance.add_dynamic_partitions("input_tables", ["headlines_20261102"])
        # A restart with a lost (or garbled) cursor launches nothing twice.
        for cursor in (None, "not json", second.cursor):
            again = tick(sensor, instance, incoming, cursor=cursor)
            assert not again.run_requests and "No new tables" in again.skip_reason.skip_message
        assert json.loads(second.cursor)["tables_seen"] == 2
        # The run request's key is the table: Dagster itself refuses to launch a key twice.
        assert first.run_requests[0].run_key == "table:headlines_20261101"


def test_the_sensor_sweeps_any_number_of_tables_in_bounded_pages(tmp_path):
    path = str(tmp_path / "many.duckdb")
    con = duckdb.connect(path)
    con.execute("CREATE SCHEMA incoming")
    names = [f"headlines_2026{i:04d}" for i in range(40)]
    for name in [*names, "notes", "aaa_other"]:
        con.execute(f"CREATE TABLE incoming.{name} (id INT, headline VARCHAR)")
    con.close()
    sensor = build_new_input_tables_sensor(
        asset=table_asset(),
        dataset="incoming",
        table_pattern=r"headlines_\d{8}",
        max_tables_per_tick=5,
        tables_per_page=8,
    )
    launched: list[str] = []
    cursor = None
    with dg.instance_for_test() as instance:
        for _ in range(30):
            result = tick(sensor, instance, path, cursor=cursor)
            cursor = result.cursor
            keys = [r.partition_key for r in result.run_requests or []]
            assert len(keys) <= 5  # bounded work per tick
            if keys:
                instance.add_dynamic_partitions("input_tables", keys)  # as the daemon
            launched += keys
        assert launched == names  # every table, once, in name order
        # A table whose name sorts before the cursor is found by the next sweep.
        con = duckdb.connect(path)
        con.execute("CREATE TABLE incoming.headlines_20250101 (id INT, headline VARCHAR)")
        con.close()
        found = []
        for _ in range(8):
            result = tick(sensor, instance, path, cursor=cursor)
            cursor = result.cursor
            found += [r.partition_key for r in result.run_requests or []]
        assert found == ["headlines_20250101"]
        assert json.loads(cursor)["sweeps"] >= 1


def test_tables_whose_names_a_run_cannot_read_are_skipped_with_one_warning_each(tmp_path, capfd):
    """A table name a run would refuse (a hyphen, a space, a leading digit, a non-ASCII letter)
    is not made a partition whose every run fails: it is skipped, warned about once."""
    path = str(tmp_path / "odd.duckdb")
    good = ["headlines_1", "headlines_2"]
    odd = ["headlines-3", "headlines 4", "headlines_5é", "9headlines"]
    with duckdb.connect(path) as con:
        con.execute("CREATE SCHEMA incoming")
        for name in good + odd:
            con.execute(f'CREATE TABLE incoming."{name}" (id INT, headline VARCHAR)')
    sensor = build_new_input_tables_sensor(
        asset=table_asset(), dataset="incoming", table_pattern=r".*headlines.*"
    )
    with dg.instance_for_test() as instance:
        first = tick(sensor, instance, path)
        assert sorted(r.partition_key for r in first.run_requests) == good
        instance.add_dynamic_partitions("input_tables", good)
        again = tick(sensor, instance, path, cursor=first.cursor)
        assert not again.run_requests
    # The sensor context's log writes to the console (stderr).
    warnings = [line for line in capfd.readouterr().err.splitlines() if "Skipped table" in line]
    for name in odd:  # one warning each, over both ticks, naming the table and the rule
        assert sum(repr(name) in w for w in warnings) == 1, (name, warnings)
    assert len(warnings) == len(odd)
    assert all("letters, digits and underscores" in w for w in warnings)


def test_a_new_partition_reads_its_whole_table(incoming, fresh_sim):
    asset = table_asset()
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("input_tables", ["headlines_20261102"])
        result = dg.materialize(
            [asset],
            instance=instance,
            partition_key="headlines_20261102",
            resources={
                "llm": LLMResource(base_url=fresh_sim.url, api_key=SIM_KEY, model="sim-1"),
                "warehouse": DuckDBWarehouse(database=incoming),
            },
        )
        md = result.asset_materializations_for_node("incoming_sentiment")[0].metadata
        assert md["partition/rows_ok"].value == 5


def test_sensor_errors_are_clear(incoming):
    with pytest.raises(BatchLLMError, match="not a valid regular expression"):
        build_new_input_tables_sensor(asset=table_asset(), dataset="incoming", table_pattern="(")
    with pytest.raises(BatchLLMError, match="Invalid dataset"):
        build_new_input_tables_sensor(asset=table_asset(), dataset="x; drop", table_pattern=".*")
    daily = build_llm_batch_asset(
        name="d",
        source=SourceTable(table="t", partition_column="day", columns=["x"]),
        prompt="{{ x }}",
        output="o",
    )
    with pytest.raises(BatchLLMError, match="DynamicPartitionsDefinition"):
        build_new_input_tables_sensor(asset=daily, dataset="incoming", table_pattern=".*")
    sensor = build_new_input_tables_sensor(
        asset=table_asset(), dataset="missing", table_pattern=".*"
    )
    with dg.instance_for_test() as instance:
        result = tick(sensor, instance, incoming)
        assert "'missing' does not exist" in result.skip_reason.skip_message


def test_a_missing_dataset_is_warned_about_once_not_every_tick(incoming):
    # Why (issue 28): the sensor logged a missing dataset at ERROR level on every tick.
    sensor = build_new_input_tables_sensor(
        asset=table_asset(), dataset="missing", table_pattern=".*"
    )
    said: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = said.append  # type: ignore[method-assign]
    resources = {"warehouse": DuckDBWarehouse(database=incoming), "llm": LLMResource()}
    defs = dg.Definitions(assets=[table_asset()], sensors=[sensor], resources=resources)
    cursor = None
    with dg.instance_for_test() as instance:
        for _ in range(3):
            with dg.build_sensor_context(
                instance=instance, cursor=cursor, resources=resources, definitions=defs
            ) as ctx:
                ctx.log.addHandler(handler)
                result = sensor(ctx)
            assert "'missing' does not exist" in result.skip_reason.skip_message
            cursor = result.cursor
    said = [r for r in said if "'missing' does not exist" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING]
