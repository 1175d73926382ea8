"""Schedules, run notifications and asset checks of daily-partitioned assets, evaluated with
Dagster's own test contexts: the latest-partition schedule targets the latest complete day (and
stays inside the demo's range), the notification sensors post a run's figures to a webhook with
retries and only for their own assets, and the checks judge each partition on its own rows.
Split from test_sensors.py, which keeps the new-input-tables sensor."""

from __future__ import annotations

import http.server
import json
import threading
from datetime import UTC, datetime

import dagster as dg
import duckdb
import pytest

from batch_llm_assets import DuckDBWarehouse, LLMResource, SourceTable, build_llm_batch_asset
from batch_llm_assets.demo_data import create_demo_table
from batch_llm_assets.sensors import build_latest_partition_schedule, build_run_notification_sensors

from .conftest import SIM_KEY


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
