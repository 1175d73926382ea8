"""Sensors, schedules, notifications and checks, evaluated with Dagster's own test contexts."""

from __future__ import annotations

import http.server
import json
import logging
import threading
from datetime import UTC, datetime

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
from batch_llm_assets.demo_data import create_demo_table
from batch_llm_assets.engine.errors import BatchLLMError
from batch_llm_assets.sensors import (
    build_latest_partition_schedule,
    build_new_input_tables_sensor,
    build_run_notification_sensors,
)

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


def test_schedule_targets_the_latest_complete_day():
    asset = build_llm_batch_asset(
        name="daily_sentiment",
        source=SourceTable(table="news", partition_column="published_at", columns=["headline"]),
        prompt="{{ headline }}",
        output="out",
        partitions_def=dg.DailyPartitionsDefinition(start_date="2026-01-01"),
    )
    schedule = build_latest_partition_schedule(asset=asset, hour_of_day=2)
    defs = dg.Definitions(
        assets=[asset],
        schedules=[schedule],
        resources={"llm": LLMResource(), "warehouse": DuckDBWarehouse(database=":memory:")},
    )
    resolved = defs.get_schedule_def("daily_sentiment_latest_partition")
    assert resolved.cron_schedule == "0 2 * * *"
    ctx = dg.build_schedule_context(
        scheduled_execution_time=datetime(2026, 11, 5, 2, tzinfo=UTC),
        repository_def=defs.get_repository_def(),
    )
    requests = resolved.evaluate_tick(ctx).run_requests
    assert [r.partition_key for r in requests] == ["2026-11-04"]


def test_the_demo_schedule_targets_partitions_inside_the_demos_range():
    # Why (issue 28): the next tick targeted a partition after the demo's end_date.
    from batch_llm_assets import definitions

    schedule = definitions.defs.get_schedule_def("headline_sentiment_latest_partition")
    keys = set(definitions.demo_partitions.get_partition_keys())
    for when in (datetime(2026, 11, 5, 1, tzinfo=UTC), datetime(2027, 3, 1, 1, tzinfo=UTC)):
        ctx = dg.build_schedule_context(
            scheduled_execution_time=when,
            repository_def=definitions.defs.get_repository_def(),
        )
        (request,) = schedule.evaluate_tick(ctx).run_requests
        assert request.partition_key in keys
    early = dg.build_schedule_context(
        scheduled_execution_time=datetime(2026, 10, 1, 1, tzinfo=UTC),
        repository_def=definitions.defs.get_repository_def(),
    )
    assert not schedule.evaluate_tick(early).run_requests  # nothing has closed yet: a skip


class _Receiver(http.server.BaseHTTPRequestHandler):
    posts: list = []
    fail_first = 0

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if _Receiver.fail_first > 0:
            _Receiver.fail_first -= 1
            self.send_response(503)
            self.end_headers()
            return
        _Receiver.posts.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    _Receiver.posts, _Receiver.fail_first = [], 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hooks/T000/B000/secret-token"
    server.shutdown()


def _daily_asset(**kw):
    return build_llm_batch_asset(
        name="sentiment",
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt="Headline: {{ headline }}. Answer with one of: up, down",
        output="news_sentiment",
        partitions_def=dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-03"),
        **kw,
    )


def test_notification_posts_the_runs_figures_with_retries(receiver, fresh_sim, tmp_path):
    db = str(tmp_path / "n.duckdb")
    create_demo_table(db, days=2, per_day=20)
    secret = "sk-notify-secret-key-123456"
    fresh_sim.configure(api_key=secret)
    on_success, on_failure = build_run_notification_sensors(
        webhook_url=receiver, dagster_url="http://dagster.example:3000"
    )
    resources = {
        "llm": LLMResource(
            base_url=fresh_sim.url, api_key=secret, model="gpt-4o-mini", max_attempts=1
        ),
        "warehouse": DuckDBWarehouse(database=db),
    }
    with dg.instance_for_test() as instance:
        ok = dg.materialize(
            [_daily_asset()], instance=instance, resources=resources, partition_key="2026-11-01"
        )
        _Receiver.fail_first = 1  # the webhook fails once: the post is retried
        on_success(
            dg.build_run_status_sensor_context(
                sensor_name=on_success.name,
                dagster_instance=instance,
                dagster_run=ok.dagster_run,
                dagster_event=ok.get_run_success_event(),
            )
        )
        fresh_sim.configure(fail_503=1.0)
        bad = dg.materialize(
            [_daily_asset()],
            instance=instance,
            resources=resources,
            partition_key="2026-11-02",
            raise_on_error=False,
        )
        on_failure(
            dg.build_run_status_sensor_context(
                sensor_name=on_failure.name,
                dagster_instance=instance,
                dagster_run=bad.dagster_run,
                dagster_event=bad.get_run_failure_event(),
            ).for_run_failure()
        )
    assert len(_Receiver.posts) == 2
    success, failure = (p["text"] for p in _Receiver.posts)
    assert "success" in success and "sentiment [2026-11-01]: 20 ok, 0 failed" in success
    assert "cost not priced" in success  # the simulator is a local server: not priced
    assert f"http://dagster.example:3000/runs/{ok.dagster_run.run_id}" in success
    assert "failure" in failure and "0 ok, 20 failed" in failure
    for text in (success, failure):
        assert secret not in text and "secret-token" not in text


def test_notifications_announce_only_runs_of_their_assets(receiver, fresh_sim, tmp_path):
    db = str(tmp_path / "w.duckdb")
    create_demo_table(db, days=1, per_day=5)
    mine, theirs = (
        build_run_notification_sensors(
            webhook_url=receiver, asset_keys=[dg.AssetKey(key)], name_prefix=key
        )[0]
        for key in ("sentiment", "someone_else")
    )
    resources = {
        "llm": LLMResource(base_url=fresh_sim.url, api_key=SIM_KEY, model="sim-1"),
        "warehouse": DuckDBWarehouse(database=db),
    }
    with dg.instance_for_test() as instance:
        run = dg.materialize(
            [_daily_asset()], instance=instance, resources=resources, partition_key="2026-11-01"
        )
        for sensor in (mine, theirs):
            sensor(
                dg.build_run_status_sensor_context(
                    sensor_name=sensor.name,
                    dagster_instance=instance,
                    dagster_run=run.dagster_run,
                    dagster_event=run.get_run_success_event(),
                )
            )
    assert len(_Receiver.posts) == 1 and "sentiment [2026-11-01]" in _Receiver.posts[0]["text"]


def test_checks_belong_to_their_partition_and_warn_below_the_run_threshold(fresh_sim, tmp_path):
    """Each materialisation reports checks on its own partition's rows: a bad day warns (WARN,
    1 % threshold) without failing its run (50 %), and the next day's checks stay green."""
    db = str(tmp_path / "c.duckdb")
    create_demo_table(db, days=2, per_day=20)
    con = duckdb.connect(db)
    con.execute("UPDATE news_headlines SET headline = NULL WHERE id = 1")  # day 1's row
    con.close()
    asset = _daily_asset(max_failed_fraction=0.5)
    resources = {
        "llm": LLMResource(base_url=fresh_sim.url, api_key=SIM_KEY, model="sim-1"),
        "warehouse": DuckDBWarehouse(database=db),
    }
    with dg.instance_for_test() as instance:

        def checks(day):
            result = dg.materialize(
                [asset], partition_key=day, resources=resources, instance=instance
            )
            assert result.success
            return {e.check_name: e for e in result.get_asset_check_evaluations()}

        bad = checks("2026-11-01")
        assert not bad["failed_fraction"].passed  # 1 of 20 failed: 5 % > 1 %
        assert bad["failed_fraction"].severity == dg.AssetCheckSeverity.WARN
        assert bad["failed_fraction"].metadata["rows_failed"].value == 1
        assert bad["row_count_matches_input"].passed
        good = checks("2026-11-02")  # after the bad day: its own figures, not the latest event's
        assert good["failed_fraction"].passed and good["row_count_matches_input"].passed
        assert good["failed_fraction"].metadata["rows_failed"].value == 0
        again = checks("2026-11-01")  # a rerun sends only the bad row: judged on all 20
        assert again["failed_fraction"].metadata["failed_fraction"].value == pytest.approx(0.05)
        assert again["row_count_matches_input"].metadata["rows_output"].value == 20
