"""The partition run's journal and what it stores: ids keep their types and are recovered in
chunks, an embedding comes back bit for bit, a read-only or full disk (a real tmpfs) fails
naming the path and keeps every paid answer, an answer reaches the journal before the limiter
hears of it, and values the warehouse cannot store (a lone surrogate, a refused value) fail
their row only. Helpers and fixtures are test_pipeline.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from datetime import UTC, date, datetime
from decimal import Decimal
from uuid import UUID

import numpy as np
import pytest
import redis

from batch_llm_assets import ChatRequest, DuckDBWarehouse, LLMResource
from batch_llm_assets.assets.journal import ResultJournal, journal_key
from batch_llm_assets.warehouses.duckdb_session import DuckDBSession

from .conftest import SIM_KEY
from .conftest import duckdb_query as query
from .test_pipeline import (
    PK,
    _empty_journal,  # noqa: F401  (fixture)
    _journal_dir,
    db,  # noqa: F401  (fixture)
    failure,
    run,
)

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


def test_a_full_disk_stops_sending_and_keeps_every_paid_answer(fresh_sim, db, tiny_disk):  # noqa: F811
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


# -- the journal before the limiter ----------------------------------------------------------------


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


# -- unstorable values ----------------------------------------------------------------------------


def test_a_lone_surrogate_in_an_answer_is_stored_replaced_and_blocks_nothing(fresh_sim, db):  # noqa: F811
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


def test_a_refused_value_fails_its_row_only(fresh_sim, db):  # noqa: F811
    result = run(db, fresh_sim, warehouse=RefusingWarehouse(database=db))
    bad = query(db, "SELECT id, error FROM news_sentiment WHERE error_class = 'unstorable_value'")
    assert bad and all(i % 50 == 0 for i, _ in bad)
    assert all("invalid value in column response" in e for _, e in bad)
    assert query(db, "SELECT count(*) FROM news_sentiment") == [(1000,)]
    assert result.success  # a few rows (< 5%) failed; the rest were stored
