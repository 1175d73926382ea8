"""Identical requests sent once in batch mode (issue 30): the batch file holds each distinct
request of a partition once, the other rows take its answer (`shared_from`) when the batch is
collected, by whichever run collects it; answers stored `ok` are reused instead of put in a
file. Counted at the simulator (lines of the submitted files); DuckDB holds what was written."""

from __future__ import annotations

import duckdb

from batch_llm_assets.assets.batch_mode import BatchSettings

from .conftest import duckdb_query as query
from .test_answer_reuse import overlapping_days
from .test_batch_mode import batch_config, bsim  # noqa: F401  (bsim: a fixture)
from .test_sharing import DAY1, DAY2, check_shared, make_table, metadata, rows_of, with_duplicates
from .test_sharing import asset as live_asset
from .test_sharing import materialize as materialize_live


def asset(**batch):
    return live_asset(
        mode="batch", batch=BatchSettings(**({"poll_first_s": 0.2, "poll_max_s": 0.5} | batch))
    )


def materialize(a, sim, db, key=DAY1):
    return materialize_live(a, sim, db, key=key)


def lines_submitted(sim) -> int:
    return sim.stats().get("batch_lines_submitted", 0)


def test_a_batch_file_holds_each_distinct_request_once(bsim, tmp_path):  # noqa: F811
    db = str(tmp_path / "w.duckdb")
    make_table(db, {DAY1: with_duplicates(100, 60, seed=1)})
    result = materialize(asset(), bsim, db)
    assert result.success
    assert lines_submitted(bsim) == 60 and bsim.stats().get("received", 0) == 0
    rows = rows_of(db)
    assert len(rows) == 100 and {r[2] for r in rows} == {"ok"}
    check_shared(rows)  # one paying row per identity, the others name it and cost 0
    assert sum(r[6] is not None for r in rows) == 40
    md = metadata(result)
    assert md["run/requests_deduplicated"] == 40 and md["run/answers_reused"] == 0
    assert md["run/cost_saved_usd"] > 0
    again = materialize(asset(), bsim, db)  # nothing left to send
    assert again.success and lines_submitted(bsim) == 60


def test_rows_waiting_for_a_line_are_written_by_the_run_that_collects_it(bsim, tmp_path):  # noqa: F811
    db = str(tmp_path / "w.duckdb")
    make_table(db, {DAY1: with_duplicates(50, 20, seed=2)})
    assert materialize(asset(wait=False), bsim, db).success  # submitted, not collected
    assert query(db, "SELECT count(*) FROM news_sentiment") == [(0,)]
    collected = materialize(asset(), bsim, db)  # another run (the completion sensor's)
    assert collected.success and metadata(collected)["batches_submitted"] == 0
    assert lines_submitted(bsim) == 20
    rows = rows_of(db)
    assert len(rows) == 50 and {r[2] for r in rows} == {"ok"}
    check_shared(rows)


def test_batch_mode_reuses_answers_stored_by_another_partition(bsim, tmp_path):  # noqa: F811
    db = str(tmp_path / "w.duckdb")
    new = overlapping_days(db)
    assert materialize(asset(), bsim, db).success
    assert lines_submitted(bsim) == 150
    result = materialize(asset(), bsim, db, key=DAY2)
    assert result.success
    assert lines_submitted(bsim) == 150 + new  # the stored answers were not put in a file
    md = metadata(result)
    assert md["run/answers_reused"] >= 75
    assert md["run/answers_reused"] + md["run/requests_deduplicated"] == 200 - new
    day1 = {r[7]: r for r in rows_of(db, DAY1) if r[6] is None}
    day2 = rows_of(db, DAY2)
    assert len(day2) == 200 and {r[2] for r in day2} == {"ok"}
    reused = [r for r in day2 if r[6] is not None and r[6].startswith(f"{DAY1}/")]
    assert len(reused) == md["run/answers_reused"]
    for _rid, _headline, _status, response, cost, tokens, shared_from, h in reused:
        assert shared_from == f"{DAY1}/{day1[h][0]}"
        assert (response, cost, tokens) == (day1[h][3], 0, None)


def test_batch_mode_without_reuse_sends_another_partitions_requests_again(bsim, tmp_path):  # noqa: F811
    db = str(tmp_path / "w.duckdb")
    overlapping_days(db)
    assert materialize(asset(), bsim, db).success
    off = live_asset(
        mode="batch",
        reuse_answers=False,
        batch=BatchSettings(poll_first_s=0.2, poll_max_s=0.5),
    )
    assert materialize(off, bsim, db, key=DAY2).success
    assert lines_submitted(bsim) == 150 + 150  # day 2's distinct requests, once each


def test_a_row_whose_request_is_in_an_open_batch_waits_for_its_answer(bsim, tmp_path):  # noqa: F811
    db = str(tmp_path / "w.duckdb")
    make_table(db, {DAY1: with_duplicates(30, 30, seed=5)})
    batch_config(bsim, completion_s=6.0)  # still open when the next run reads the partition
    assert materialize(asset(wait=False), bsim, db).success  # 30 lines in an open batch
    con = duckdb.connect(db)  # a row added since, repeating a request of the open batch
    con.execute(
        "INSERT INTO news_headlines SELECT 1000, published_at + INTERVAL 1 SECOND, headline "
        "FROM news_headlines WHERE id = 7"
    )
    con.close()
    result = materialize(asset(), bsim, db)
    assert result.success
    assert lines_submitted(bsim) == 30  # not sent again: it took the answer once collected
    rows = {r[0]: r for r in rows_of(db)}
    assert len(rows) == 31 and rows[1000][6] == "7" and rows[1000][3] == rows[7][3]
