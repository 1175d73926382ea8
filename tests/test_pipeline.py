"""The partition pipeline under stress: slow and failing writes, a consumer that dies, SIGTERM,
a journal that cannot be written, unstorable answers, concurrent runs of one partition."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from uuid import UUID

import dagster as dg
import numpy as np
import pytest
import redis
from pydantic import Field

from batch_llm_assets import (
    ChatRequest,
    DuckDBWarehouse,
    LLMResource,
    Prompt,
    SourceTable,
    build_llm_batch_asset,
)
from batch_llm_assets.assets.journal import ResultJournal, journal_key
from batch_llm_assets.assets.lease import file_lease, redis_lease
from batch_llm_assets.engine.limiter import limiter_namespace
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


# -- the result stream is cancel-safe ----------------------------------------------------------


def _requests(n):
    return [ChatRequest(i, [{"role": "user", "content": f"row {i}"}]) for i in range(n)]


@pytest.mark.parametrize("how", ["raise", "aclose", "cancel", "full_queue"])
def test_the_result_stream_ends_promptly_and_releases_the_lease(fresh_sim, valkey_url, how):
    fresh_sim.configure(latency_ms=30.0)
    resource = llm(
        fresh_sim, rpm=100_000, redis_url=valkey_url, job_key=f"stop-{how}", max_concurrency=8
    )

    async def consume():
        got = 0
        stream = resource.chat_batch(_requests(2000))
        if how == "aclose":
            async for _ in stream:
                got += 1
                if got == 5:
                    break
            await stream.aclose()
            return got
        if how == "cancel":
            task = asyncio.create_task(_drain(stream))
            await asyncio.sleep(0.5)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return got
        async for _ in stream:
            got += 1
            if how == "full_queue":
                await asyncio.sleep(1.0)  # workers fill the bounded queue and block on it
            if got == 3:
                raise ValueError("the consumer died")
        return got

    started = time.monotonic()
    if how in ("raise", "full_queue"):
        with pytest.raises(ValueError, match="the consumer died"):
            asyncio.run(asyncio.wait_for(consume(), 30))
    else:
        asyncio.run(asyncio.wait_for(consume(), 30))
    assert time.monotonic() - started < 10
    received = fresh_sim.stats()["received"]
    time.sleep(0.5)
    assert fresh_sim.stats()["received"] == received < 2000  # nothing sent after the end
    ns = limiter_namespace(resource.base_url, resource.model, resource.api_key)
    assert redis.Redis.from_url(valkey_url).zcard(f"{ns}:leases") == 0


async def _drain(stream):
    async for _ in stream:
        pass


def _defs(
    tmp_path,
    sim,
    db,
    template="{{ headline }} Answer with one of: up, down",
    llm_kw: dict | None = None,
    **asset_kw,
):
    code = f"""
import dagster as dg
from batch_llm_assets import DuckDBWarehouse, LLMResource, Prompt, SourceTable, build_llm_batch_asset

sentiment = build_llm_batch_asset(
    name="sentiment",
    source=SourceTable(table="news_headlines", partition_column="published_at", columns=["headline"]),
    prompt=Prompt(template={template!r}),
    output="news_sentiment",
    partitions_def=dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04"),
    chunk_rows=50, **{asset_kw!r},
)
defs = dg.Definitions(assets=[sentiment], resources={{
    "llm": LLMResource(base_url="{sim.url}", api_key="{SIM_KEY}", model="gpt-4o-mini",
                       max_concurrency=8, **{llm_kw or {}!r}),
    "warehouse": DuckDBWarehouse(database="{db}"),
}})
"""
    path = tmp_path / "defs.py"
    path.write_text(code)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "dagster", "asset", "materialize", "-f", str(path)]
    cmd += ["--select", "sentiment", "--partition", PK]
    return cmd, {**os.environ, "DAGSTER_HOME": str(home)}


def _sigterm_after(proc, condition, timeout=120) -> float:
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        assert proc.poll() is None, "the run ended before it could be stopped"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # what Dagster's run termination sends
    started = time.monotonic()
    proc.wait(timeout=60)
    return time.monotonic() - started


def test_sigterm_ends_the_run_within_seconds_and_keeps_every_answer(fresh_sim, db, tmp_path):
    fresh_sim.configure(latency_ms=40.0)
    cmd, env = _defs(tmp_path, fresh_sim, db)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    took = _sigterm_after(proc, lambda: fresh_sim.stats().get("answered", 0) >= 200)
    assert took < 10 and proc.returncode != 0
    time.sleep(0.3)
    answered = fresh_sim.stats()["answered"]
    assert answered < 1000
    assert subprocess.run(cmd, env=env, capture_output=True).returncode == 0
    assert query(db, "SELECT count(*), count(DISTINCT id) FROM news_sentiment") == [(1000, 1000)]
    assert fresh_sim.stats()["answered"] - 1000 <= 8  # journaled answers were not paid twice


def test_a_run_stopped_by_sigterm_gives_its_share_of_the_key_back_at_once(
    fresh_sim, db, tmp_path, valkey_url, fresh_limiter_state
):
    """Dagster's run termination (SIGTERM) while the run is paced by the shared limiter: the
    run's lease goes as it stops, so another job on the key gets the whole limit at once, not
    when the lease lapses (JOB_LEASE_TTL_MS later)."""
    fresh_sim.configure(latency_ms=40.0)
    limited = {"rpm": 600, "redis_url": valkey_url, "job_key": "team-a"}
    cmd, env = _defs(tmp_path, fresh_sim, db, llm_kw=limited)
    ns = limiter_namespace(fresh_sim.url, "gpt-4o-mini", SIM_KEY)
    r = redis.Redis.from_url(valkey_url, decode_responses=True)

    def leased() -> list[str]:
        return [m for m in r.zrange(f"{ns}:leases", 0, -1) if m.startswith("team-a|")]

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _sigterm_after(proc, lambda: fresh_sim.stats().get("answered", 0) >= 20 and leased())
    assert proc.returncode != 0
    assert fresh_sim.stats()["answered"] < 1000  # stopped while paced, not after the work
    assert leased() == []
    assert r.hget(f"{ns}:jobs", "w:team-a") is None


def test_sigterm_stops_a_run_while_a_template_spins(fresh_sim, db, tmp_path):
    spin = (
        "{% set x = range(100000)|list %}{% for a in x %}{% for b in x %}{% endfor %}{% endfor %}"
    )
    cmd, env = _defs(
        tmp_path, fresh_sim, db, template=spin + "{{ headline }}", render_timeout_s=600
    )
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(8)  # start-up, then the first row's render spins
    took = _sigterm_after(proc, lambda: True)
    assert took < 10
    assert fresh_sim.stats().get("received", 0) == 0


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


# -- the journal ----------------------------------------------------------------------------------


def test_journal_keeps_id_types_and_recovers_in_chunks(tmp_path):
    ids = [
        7,
        "abc",
        b"\x00\xffbytes",
        Decimal("12345678901234567890.5"),
        UUID("12345678-1234-5678-1234-567812345678"),
        date(2026, 11, 1),
        datetime(2026, 11, 1, 12, 30),
        datetime(2026, 11, 1, 12, 30, tzinfo=UTC),
    ]
    j = ResultJournal(tmp_path, "scope", "pk")
    now = datetime.now(UTC)
    for i, rid in enumerate(ids):
        j.append({"id": rid, "status": "ok", "completed_at": now, "n": i})
        if i % 3 == 2:
            j.rotate()  # several segments, as a run leaves them
    j.close()
    chunks = list(ResultJournal(tmp_path, "scope", "pk").recover_chunks(3))
    assert [len(c) for c in chunks] == [3, 3, 2]
    back = [r["id"] for c in chunks for r in c]
    assert back == ids and [type(x) for x in back] == [type(x) for x in ids]
    assert all(r["completed_at"] == now for c in chunks for r in c)
    # A torn last line (the process died mid-write) is skipped, not fatal.
    seg = sorted(tmp_path.glob("*.jsonl"))[-1]
    seg.write_text(seg.read_text() + '{"id": 99, "sta')
    assert (
        len([r for c in ResultJournal(tmp_path, "scope", "pk").recover_chunks(100) for r in c]) == 8
    )


def test_the_journal_gives_back_an_embedding_bit_for_bit(tmp_path):
    """A float32 vector is journaled as its bytes: a recovered row stores the same numbers."""
    vec = np.array([0.1, -2.5, 3e-8, 1 / 3], dtype=np.float32)
    j = ResultJournal(tmp_path, "scope", "pk")
    j.append({"id": 1, "status": "ok", "embedding": vec})
    j.close()
    [[row]] = list(ResultJournal(tmp_path, "scope", "pk").recover_chunks(10))
    back = row["embedding"]
    assert back.dtype == np.float32 and back.tobytes() == vec.tobytes()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KiB tmpfs for the journal (needs root, as in CI's container); ENOSPC for real."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root; run this suite as root (the CI container is)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_read_only_journal_fails_naming_the_path_and_the_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        pytest.fail("mounting a read-only tmpfs needs root (the CI container is root)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], check=True)
    try:
        journal = ResultJournal(ro, "scope", "pk")
        journal.append({"id": 1, "status": "ok"})  # held until the end of the loop's turn
        with pytest.raises(Exception, match="Read-only file system") as err:
            journal.flush()
        assert str(ro) in err.value.description and "errno 30" in err.value.description
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


def test_a_full_disk_stops_sending_and_keeps_every_paid_answer(fresh_sim, db, tiny_disk):
    """ENOSPC for real: the journal is on a 64 KiB tmpfs, which fills after a few hundred
    answers. Sending stops at once; the requests already on the wire still come back (they
    were paid) and go to the warehouse with the others, so the rerun pays none of them again."""
    fresh_sim.configure(latency_ms=20.0)
    old = os.environ["BATCH_LLM_JOURNAL_DIR"]
    os.environ["BATCH_LLM_JOURNAL_DIR"] = str(tiny_disk)
    try:
        result = run(db, fresh_sim, max_concurrency=64)
    finally:
        os.environ["BATCH_LLM_JOURNAL_DIR"] = old
    assert not result.success
    message = failure(result)
    assert str(tiny_disk) in message and "No space left on device" in message
    answered = fresh_sim.stats()["answered"]
    assert answered < 1000  # sending stopped at once
    # Every answer the provider sent (and billed) is in the warehouse.
    assert query(db, "SELECT count(*) FROM news_sentiment WHERE status = 'ok'") == [(answered,)]
    rerun = run(db, fresh_sim)
    assert rerun.success
    assert fresh_sim.stats()["answered"] == 1000  # nothing paid twice
    assert query(db, "SELECT count(*), min(status) FROM news_sentiment") == [(1000, "ok")]


# -- unstorable values ----------------------------------------------------------------------------


def test_a_lone_surrogate_in_an_answer_is_stored_replaced_and_blocks_nothing(fresh_sim, db):
    fresh_sim.configure(surrogate_every=7)
    assert run(db, fresh_sim).success
    assert fresh_sim.stats()["fault_surrogate"] >= 100
    rows = query(
        db, "SELECT count(*), count(*) FILTER (WHERE response LIKE '%\ufffd') FROM news_sentiment"
    )
    assert rows[0][0] == 1000 and rows[0][1] >= 100
    # A journal left by an older run with such an answer in it is recovered, not wedged.
    key = journal_key(f"{DuckDBWarehouse(database=db).identity()}|news_sentiment", PK)
    (_journal_dir() / f"{key}.00000001.jsonl").write_text(
        json.dumps(
            {
                "id": 1,
                "partition_key": PK,
                "response": "up\ud83d",
                "status": "ok",
                "request_hash": "x",
                "completed_at": {"$dt": "2026-11-01T00:00:00+00:00"},
            }
        )
        + "\n"
    )
    assert run(db, fresh_sim).success
    assert query(db, "SELECT response FROM news_sentiment WHERE id = 1") == [("up\ufffd",)]


class _RefusingSession(DuckDBSession):
    """A warehouse that refuses one value (as BigQuery refuses some text DuckDB takes): a stand-in
    for a refusal DuckDB cannot produce without invalidating the database."""

    def write_results(self, output, rows):
        if any(r.get("response") == "down" and r["id"] % 50 == 0 for r in rows):
            raise ValueError("invalid value in column response")
        super().write_results(output, rows)


class RefusingWarehouse(DuckDBWarehouse):
    @contextlib.contextmanager
    def session(self):
        with self.get_connection() as conn:
            try:
                yield _RefusingSession(conn)
            finally:
                conn.close()


def test_a_refused_value_fails_its_row_only(fresh_sim, db):
    result = run(db, fresh_sim, warehouse=RefusingWarehouse(database=db))
    bad = query(db, "SELECT id, error FROM news_sentiment WHERE error_class = 'unstorable_value'")
    assert bad and all(i % 50 == 0 for i, _ in bad)
    assert all("invalid value in column response" in e for _, e in bad)
    assert query(db, "SELECT count(*) FROM news_sentiment") == [(1000,)]
    assert result.success  # a few rows (< 5%) failed; the rest were stored


# -- one run per partition ------------------------------------------------------------------------


def _scope(db) -> str:
    return journal_key(f"{DuckDBWarehouse(database=db).identity()}|news_sentiment", PK)


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_a_second_run_of_a_partition_is_refused_and_the_first_journal_untouched(
    fresh_sim, db, valkey_url, backend
):
    key = _scope(db)
    planted = _journal_dir() / f"{key}.00000001.jsonl"
    planted.write_text('{"id": 1, "status": "ok"}\n')
    holder = (
        file_lease(_journal_dir() / f"{key}.lock", "p", "run-A")
        if backend == "file"
        else redis_lease(valkey_url, key, "p", "run-A", ttl_s=5)
    )
    kw = {"redis_url": valkey_url} if backend == "redis" else {}
    with holder:
        result = run(db, fresh_sim, **kw)
    assert not result.success
    message = failure(result)
    assert "already being processed by run run-A" in message
    assert fresh_sim.stats().get("received", 0) == 0
    assert planted.read_text() == '{"id": 1, "status": "ok"}\n'
    assert query(
        db, "SELECT count(*) FROM information_schema.tables WHERE table_name = 'news_sentiment'"
    ) == [(0,)]


_HOLD = """
import sys, time
from pathlib import Path
from batch_llm_assets.assets.lease import file_lease, redis_lease
backend, where = sys.argv[1], sys.argv[2]
lease = file_lease(Path(where), "p", "run-K") if backend == "file" else redis_lease(where, "k", "p", "run-K", ttl_s=1.0)
with lease:
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("backend", ["file", "redis"])
def test_the_lease_lapses_when_its_holder_is_killed(tmp_path, valkey_url, backend):
    where = str(tmp_path / "k.lock") if backend == "file" else valkey_url
    if backend == "redis":
        redis.Redis.from_url(valkey_url).delete("batch_llm:partition_lease:k")
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, backend, where], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"held"

    def take():
        if backend == "file":
            return file_lease(Path(where), "p", "run-L")
        return redis_lease(where, "k", "p", "run-L", ttl_s=1.0)

    time.sleep(1.5)  # the holder renews: still held after more than one TTL
    with pytest.raises(Exception, match="run-K"), take():
        pass
    proc.kill()  # SIGKILL: no cleanup
    proc.wait()
    deadline = time.monotonic() + 5
    while True:
        try:
            with take():
                break
        except Exception:
            assert time.monotonic() < deadline, "the lease did not lapse"
            time.sleep(0.1)


def test_an_answer_reaches_the_journal_hook_before_the_limiter_hears_of_it(fresh_sim, valkey_url):
    """The journal gets an answer before anything that can wait on Redis (the reconcile, the
    provider-state feedback): with Redis refusing writes for 4 s while the answer is in
    flight, the hook still sees it at once, and the feedback catches up afterwards."""
    fresh_sim.configure(latency_ms=800, jitter=0.0)
    llm = LLMResource(
        base_url=fresh_sim.url,
        api_key=SIM_KEY,
        model="sim-1",
        rpm=600,
        tpm=600_000,
        redis_url=valkey_url,
    )
    seen: list[float] = []
    pause_ends: list[float] = []

    async def run() -> list:
        admin = redis.asyncio.Redis.from_url(valkey_url)

        async def pause_writes() -> None:
            await asyncio.sleep(0.3)  # the request holds its slot and is at the provider
            await admin.execute_command("CLIENT", "PAUSE", "4000", "WRITE")
            pause_ends.append(time.monotonic() + 4.0)

        try:
            async with llm.engine() as engine:
                pauser = asyncio.create_task(pause_writes())
                reqs = [ChatRequest(1, [{"role": "user", "content": "hello there"}])]
                out = [
                    r
                    async for r in engine.map(
                        reqs, on_result=lambda r: seen.append(time.monotonic())
                    )
                ]
                await pauser
                return out
        finally:
            await admin.aclose()

    results = asyncio.run(run())
    assert [r.status for r in results] == ["ok"]
    assert seen and pause_ends and seen[0] < pause_ends[0] - 2.0


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
