"""The partition pipeline's writer and renderer: a writer that is slow or fails, the final write
following the last answer, templates bounded in time and size, plain templates rendered exactly
as Jinja does. Stopping a run and one run per partition are in test_pipeline_stops_and_leases.py;
the journal and unstorable answers in test_pipeline_journal.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from datetime import date
from decimal import Decimal
from pathlib import Path
from uuid import UUID

import dagster as dg
import pytest
from pydantic import Field

from batch_llm_assets import (
    DuckDBWarehouse,
    LLMResource,
    Prompt,
    SourceTable,
    build_llm_batch_asset,
)
from batch_llm_assets.assets.journal import ResultJournal
from batch_llm_assets.warehouses.duckdb_session import DuckDBSession

from .conftest import SIM_KEY, create_distinct_table
from .conftest import duckdb_query as query

DAY = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-03")
PK = "2026-11-01"


class _InjectedSession(DuckDBSession):
    """A real DuckDB session whose writes take `delay_s` longer, or raise from the Nth on: a
    warehouse that is slow (a BigQuery MERGE is a job of seconds) or fails mid-run."""

    delay_s = 0.0
    fail_from: int = 0
    journal_lines: list[int]

    def write_results(self, output, rows):
        self.writes = getattr(self, "writes", 0) + 1
        self.journal_lines.append(_journal_lines())
        if self.fail_from and self.writes >= self.fail_from:
            raise RuntimeError("warehouse is down (injected)")
        time.sleep(self.delay_s)
        super().write_results(output, rows)


class InjectedWarehouse(DuckDBWarehouse):
    write_delay_s: float = Field(default=0.0, description="Extra seconds per write.")
    fail_from_write: int = Field(default=0, description="Writes from this one on raise; 0: none.")

    @contextlib.contextmanager
    def session(self):
        with self.get_connection() as conn:
            s = _InjectedSession(conn)
            s.delay_s, s.fail_from, s.journal_lines = self.write_delay_s, self.fail_from_write, []
            SESSIONS.append(s)
            try:
                yield s
            finally:
                conn.close()


SESSIONS: list[_InjectedSession] = []


def _journal_dir() -> Path:
    return Path(os.environ["BATCH_LLM_JOURNAL_DIR"])


def _journal_lines() -> int:
    return sum(len(p.read_text().splitlines()) for p in _journal_dir().glob("*.jsonl"))


def sentiment(**kw):
    settings = dict(
        name="sentiment",
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=Prompt(template="{{ headline }} Answer with one of: up, down"),
        output="news_sentiment",
        partitions_def=DAY,
        chunk_rows=100,
    )
    return build_llm_batch_asset(**(settings | kw))


def llm(sim, **kw):
    base = {"base_url": sim.url, "api_key": SIM_KEY, "model": "gpt-4o-mini", "max_attempts": 3}
    return LLMResource(**(base | kw))


def run(db, sim, a=None, warehouse=None, **llm_kw):
    return dg.materialize(
        [a or sentiment()],
        partition_key=PK,
        raise_on_error=False,
        resources={
            "llm": llm(sim, **llm_kw),
            "warehouse": warehouse or DuckDBWarehouse(database=db),
        },
    )


def failure(result) -> str:
    return result.get_step_failure_events()[0].step_failure_data.error.message


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "p.duckdb")
    create_distinct_table(path, days=1, per_day=1000)
    return path


@pytest.fixture(autouse=True)
def _empty_journal():
    for p in _journal_dir().glob("*"):
        p.unlink()
    SESSIONS.clear()


# -- a writer that is slow or fails -------------------------------------------------------------


def _answer_span(db) -> float:
    lo, hi = query(db, "SELECT min(completed_at), max(completed_at) FROM news_sentiment")[0]
    return (hi - lo).total_seconds()


def test_a_two_second_write_does_not_slow_the_answers(fresh_sim, db, tmp_path):
    fresh_sim.configure(latency_ms=20.0)
    fast = run(db, fresh_sim, max_concurrency=16)
    assert fast.success
    fast_span = _answer_span(db)
    slow_db = str(tmp_path / "slow.duckdb")
    create_distinct_table(slow_db, days=1, per_day=1000)
    slow = run(
        slow_db,
        fresh_sim,
        warehouse=InjectedWarehouse(database=slow_db, write_delay_s=2.0),
        max_concurrency=16,
    )
    assert slow.success
    assert query(slow_db, "SELECT count(*), count(DISTINCT id) FROM news_sentiment") == [
        (1000, 1000)
    ]
    slow_span = _answer_span(slow_db)
    writes = SESSIONS[-1].writes
    print(json.dumps({"fast_span_s": fast_span, "slow_span_s": slow_span, "writes": writes}))
    # Answers keep their pace while a write is in flight (on main: one row per 2 s write).
    assert slow_span <= 2 * fast_span + 1.0
    assert writes <= slow_span / 2 + 3  # a few big writes, not one per row
    # The journal is trimmed after each confirmed write: never the whole partition on disk.
    assert max(SESSIONS[-1].journal_lines) < 1000 and _journal_lines() == 0


def test_a_failing_writer_ends_the_run_with_its_error_and_loses_nothing(fresh_sim, db):
    fresh_sim.configure(latency_ms=20.0)
    started = time.monotonic()
    result = run(
        db,
        fresh_sim,
        warehouse=InjectedWarehouse(database=db, fail_from_write=2, write_delay_s=0.3),
        max_concurrency=8,
    )
    took = time.monotonic() - started
    assert not result.success and took < 30
    message = failure(result)
    assert "warehouse is down (injected)" in message and "journal" in message
    answered = fresh_sim.stats()["answered"]
    assert answered < 1000  # sending stopped
    # The rerun writes what the journal kept and sends only what was never answered.
    assert run(db, fresh_sim, max_concurrency=8).success
    assert query(db, "SELECT count(*), count(DISTINCT id) FROM news_sentiment") == [(1000, 1000)]
    assert fresh_sim.stats()["answered"] - 1000 <= 8  # at most the requests in flight


def test_the_final_write_follows_the_last_answer_instead_of_queueing(tmp_path):
    """When the last answers are due within one write's duration, the writer waits for them
    rather than start a write that the final one would queue behind (a BigQuery MERGE takes
    seconds): the final write starts with the last answer and carries every remaining row."""
    from batch_llm_assets.assets.writer import ChunkWriter

    journal = ResultJournal(tmp_path, "scope", "pk")
    starts: list[tuple[float, int]] = []

    def write(rows):
        starts.append((time.monotonic(), len(rows)))
        time.sleep(0.5)

    eta: list[float | None] = [None]

    async def main() -> float:
        writer = ChunkWriter(write, journal, interval_s=0.1, last_answer_eta=lambda: eta[0])
        task = asyncio.create_task(writer.run())
        for i in range(10):
            writer.add({"id": i})
        await asyncio.sleep(0.7)  # the first write (0.5 s) is done: its duration is known
        eta[0] = 0.3  # the remaining answers are due within one write's duration
        for i in range(10, 20):
            writer.add({"id": i})
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        last_answer = time.monotonic()
        await writer.close()
        await task
        return last_answer

    last_answer = asyncio.run(main())
    assert [n for _, n in starts] == [10, 10]  # nothing written in between
    assert starts[-1][0] >= last_answer


# -- templates bounded in time and size ---------------------------------------------------------


@pytest.mark.parametrize(
    "template,error_class",
    [
        (
            "{% set x = range(100000)|list %}{% for a in x %}{% for b in x %}{% endfor %}"
            "{% endfor %}{{ headline }}",
            "prompt_render",
        ),
        ("{{ headline * 20000000 }}", "prompt_too_large"),
        (
            "{% for a in range(100000) %}{% for b in range(100000) %}{{ headline }}{% endfor %}"
            "{% endfor %}",
            "prompt_too_large",
        ),
    ],
)
def test_templates_are_bounded_in_time_and_size(fresh_sim, tmp_path, template, error_class):
    db = str(tmp_path / "t.duckdb")
    create_distinct_table(db, days=1, per_day=3)
    a = sentiment(prompt=Prompt(template=template), render_timeout_s=0.3, max_failed_fraction=1.0)
    started = time.monotonic()
    assert run(db, fresh_sim, a).success
    assert time.monotonic() - started < 30
    assert query(db, "SELECT DISTINCT status, error_class FROM news_sentiment") == [
        ("failed", error_class)
    ]
    assert fresh_sim.stats().get("received", 0) == 0


@pytest.mark.parametrize(
    "template,error_class",
    [
        (
            "{% set x = range(100000)|list %}{% for a in x %}{% for b in x %}{% endfor %}"
            "{% endfor %}{{ headline }}",
            "prompt_render",
        ),
        ("{{ headline * 20000000 }}", "prompt_too_large"),
    ],
)
def test_a_template_that_fails_every_row_stops_the_run_naming_it(
    fresh_sim, tmp_path, template, error_class
):
    """The template breaker: 10 consecutive rows failing to render the same way end the run
    with the template problem, instead of failing every row one render time limit at a time
    (a 100,000-row partition at 1 s a row: over a day)."""
    db = str(tmp_path / "t.duckdb")
    create_distinct_table(db, days=1, per_day=60)
    a = sentiment(prompt=Prompt(template=template), render_timeout_s=0.3, max_failed_fraction=1.0)
    started = time.monotonic()
    result = run(db, fresh_sim, a)
    took = time.monotonic() - started
    assert not result.success
    message = failure(result)
    assert f"template failed on 10 consecutive rows with {error_class}" in message
    assert "Fix the template" in message
    assert took < 15  # 10 renders at the limit, not 60 (18 s of spinning)
    assert fresh_sim.stats().get("received", 0) == 0
    # The rows that tripped it are written with their reason; none is done, so a rerun with a
    # fixed template renders every row again.
    assert query(db, "SELECT count(*), min(error_class), max(status) FROM news_sentiment") == [
        (10, error_class, "failed")
    ]


@pytest.mark.parametrize(
    "template,system",
    [
        ("{{ headline }}. Up, down or flat?", None),
        ("Rate: {{ headline }}\n\n{{ n }} {{ x }} {{ flag }}\n", "You rate {{ topic }}."),
        ("{{ headline }}{{ headline }}", "{{ blob }}"),
        ("{{ topic }} ", None),
        ("{{ headline }}", "{{ n }}"),
    ],
)
def test_plain_templates_render_exactly_as_jinja_does(template, system):
    """Text with `{{ column }}` holes skips Jinja's machinery: the output, the NULL and size
    failures must be the sandbox's own, for every kind of value."""
    from batch_llm_assets.assets.prompt import CompiledPrompt

    cols = ("headline", "n", "x", "flag", "topic", "blob")
    fast = CompiledPrompt(Prompt(template=template, system=system), cols)
    slow = CompiledPrompt(Prompt(template=template, system=system), cols)
    assert fast._user_plan is not None
    slow._user_plan = slow._system_plan = None  # the sandbox path
    rows = [
        dict(headline="Stocks rise", n=3, x=2.5, flag=True, topic="équités", blob=b"\xffab"),
        dict(headline="é" * 50, n=-0, x=float("nan"), flag=False, topic="", blob=b""),
        dict(headline=None, n=1, x=1e300, flag=None, topic="t", blob=None),
        dict(headline="", n=0, x=0.1, flag=True, topic="  ", blob=b"x"),
        dict(headline="big" * 40, n=10**30, x=-1.0, flag=True, topic="t", blob=b"y"),
        dict(
            headline=Decimal("1.50"), n=date(2026, 1, 2), x=UUID(int=5), flag=[1], topic={}, blob=1
        ),
    ]
    for row in rows:
        for limit in (None, 60):
            assert fast.render(row, max_chars=limit) == slow.render(row, max_chars=limit), row
