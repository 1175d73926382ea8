"""UTC-exact time-window slices of a DuckDB source: TIMESTAMP, TIMESTAMPTZ, DATE and ISO-8601
string columns sliced on UTC days whatever the process's and DuckDB's time zones (rows on and
1 µs either side of both midnights), a window given in another zone, clear errors for other
column types and DATE windows off UTC midnights, and a daily asset end to end under Asia/Kolkata.
Split from test_warehouses.py, whose `con` fixture it uses."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

import duckdb
import pytest

from batch_llm_assets.engine.errors import BatchLLMError
from batch_llm_assets.warehouses.base import SliceFilter, SourceRef
from batch_llm_assets.warehouses.duckdb_session import DuckDBSession

from .conftest import SIM_KEY
from .conftest import duckdb_query as query
from .test_warehouses import con  # noqa: F401  (fixture)

# The tests below also name local connections `con`: not a redefinition of the fixture.
# ruff: noqa: F811


# -- UTC-exact slices ------------------------------------------------------------------------
DAY = SliceFilter(
    column="ts",
    start=datetime(2026, 11, 1, tzinfo=UTC),
    end=datetime(2026, 11, 2, tzinfo=UTC),
    label="2026-11-01",
)
TICK = timedelta(microseconds=1)
MIDNIGHT = datetime(2026, 11, 1)
# (value, in the 2026-11-01 UTC day?) per column type; rows sit on and next to both midnights.
INSTANTS = [
    (MIDNIGHT - TICK, False),
    (MIDNIGHT, True),
    (MIDNIGHT + timedelta(hours=12), True),
    (MIDNIGHT + timedelta(days=1) - TICK, True),
    (MIDNIGHT + timedelta(days=1), False),
]
DATES = [(date(2026, 10, 31), False), (date(2026, 11, 1), True), (date(2026, 11, 2), False)]
ISO = [
    ("2026-10-31T23:59:59.999999Z", False),
    ("2026-11-01T00:00:00Z", True),
    ("2026-11-01 05:29:59+05:30", False),
    ("2026-11-01T05:30:00+05:30", True),
    ("2026-11-01T00:00:00", True),
    ("2026-11-01", True),
    ("2026-11-01T23:59:59.999999", True),
    ("2026-11-01T18:59:59-05:00", True),
    ("2026-11-01T19:00:00-0500", False),
    ("2026-11-02T00:00:00+00:00", False),
    ("2026-11-02", False),
    ("2026-10-31 23:00:00", False),
]
COLUMNS = {
    "TIMESTAMP": INSTANTS,
    "TIMESTAMPTZ": [(v.replace(tzinfo=UTC), inside) for v, inside in INSTANTS],
    "DATE": DATES,
    "VARCHAR": ISO,
}


def slice_table(con, kind):
    """Table t_<kind> (id, ts <kind>, x) holding COLUMNS[kind]; the ids expected in DAY."""
    con.execute(f"CREATE TABLE t_{kind} (id INTEGER, ts {kind}, x VARCHAR)")
    for i, (value, _) in enumerate(COLUMNS[kind]):
        if kind == "TIMESTAMPTZ":  # an instant, whatever the session's TimeZone
            con.execute(
                f"INSERT INTO t_{kind} VALUES (?, CAST(? AS TIMESTAMP) AT TIME ZONE 'UTC', 'x')",
                [i, value.replace(tzinfo=None)],
            )
        else:
            con.execute(f"INSERT INTO t_{kind} VALUES (?, CAST(? AS {kind}), 'x')", [i, value])
    return {i for i, (_, inside) in enumerate(COLUMNS[kind]) if inside}


@pytest.fixture(params=["UTC", "America/New_York", "Asia/Kolkata"])
def process_tz(request, monkeypatch):
    monkeypatch.setenv("TZ", request.param)
    time.tzset()
    yield request.param
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("db_tz", ["UTC", "America/New_York", "Asia/Kolkata"])
def test_time_window_slices_are_exact_in_utc(process_tz, db_tz):
    con = duckdb.connect()
    # GLOBAL: read_slice streams on its own cursor, which takes the database's setting.
    con.execute(f"SET GLOBAL TimeZone = '{db_tz}'")
    assert con.cursor().execute("SELECT current_setting('TimeZone')").fetchone() == (db_tz,)
    s = DuckDBSession(con)
    for kind in COLUMNS:
        expected = slice_table(con, kind)
        src = SourceRef(f"t_{kind}", "id", ("x",), "ts")
        assert s.slice_stats(src, DAY) == (len(expected), [], 0), kind
        got = {r["id"] for chunk in s.read_slice(src, DAY, 2) for r in chunk}
        assert got == expected, (kind, process_tz, db_tz)
    # A window given in another time zone selects the same instants.
    ny = ZoneInfo("America/New_York")
    evening = SliceFilter(
        column="ts",
        start=datetime(2026, 10, 31, 22, tzinfo=ny),  # EDT: 02:00Z
        end=datetime(2026, 11, 1, 18, tzinfo=ny),  # EST after the DST change: 23:00Z
        label="2026-11-01",
    )
    src = SourceRef("t_TIMESTAMPTZ", "id", ("x",), "ts")
    got = {r["id"] for chunk in s.read_slice(src, evening, 100) for r in chunk}
    assert got == {2}  # noon UTC only
    con.close()


def test_slices_of_other_column_types_or_split_days_are_clear_errors(con):
    con.execute("CREATE TABLE t (id INTEGER, ts INTEGER, day DATE, x VARCHAR)")
    s = DuckDBSession(con)
    with pytest.raises(BatchLLMError, match=r"'t'.ts has type INTEGER"):
        s.slice_stats(SourceRef("t", "id", ("x",), "ts"), DAY)
    ny = ZoneInfo("America/New_York")
    ny_day = SliceFilter(
        column="day",
        start=datetime(2026, 11, 1, tzinfo=ny),
        end=datetime(2026, 11, 2, tzinfo=ny),
        label="2026-11-01",
    )
    with pytest.raises(BatchLLMError, match=r"'t'.day is a DATE .* not whole UTC days"):
        s.slice_stats(SourceRef("t", "id", ("x",), "day"), ny_day)


E2E = """
import sys, dagster as dg
from batch_llm_assets import DuckDBWarehouse, LLMResource, SourceTable, build_llm_batch_asset
db, url, key = sys.argv[1:4]
a = build_llm_batch_asset(
    name="s", source=SourceTable(table="d", partition_column="day", columns=["headline"]),
    prompt="{{ headline }}", output="o",
    partitions_def=dg.DailyPartitionsDefinition(start_date="2026-10-30"),
)
llm = LLMResource(base_url=url, api_key=key, model="gpt-4o-mini")
result = dg.materialize([a], partition_key="2026-11-01",
                        resources={"llm": llm, "warehouse": DuckDBWarehouse(database=db)})
assert result.success
"""


def test_a_daily_asset_on_a_date_column_under_kolkata(tmp_path, fresh_sim):
    """The issue's case end to end, in a process whose local time zone (and so DuckDB's default
    TimeZone) is Asia/Kolkata: partition 2026-11-01 of a DATE column took 11-02's rows."""
    db = str(tmp_path / "w.duckdb")
    with duckdb.connect(db) as con:
        con.execute("CREATE TABLE d (id INTEGER, day DATE, headline VARCHAR)")
        con.execute(
            "INSERT INTO d VALUES (1, '2026-10-31', 'a'), (2, '2026-11-01', 'b'), "
            "(3, '2026-11-01', 'c'), (4, '2026-11-02', 'd')"
        )
    env = {**os.environ, "TZ": "Asia/Kolkata"}
    run = subprocess.run(
        [sys.executable, "-c", E2E, db, fresh_sim.url, SIM_KEY],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert query(db, "SELECT id FROM o ORDER BY id") == [(2,), (3,)]
