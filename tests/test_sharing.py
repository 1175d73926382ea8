"""Identical requests sent once (issue 30) within a partition run: followers, failed leaders,
answers that left memory; hostile ids, a partition of one repeated row, lone surrogates. The
simulator counts what was sent; DuckDB holds what was written. Reuse across partitions and
runs: test_answer_reuse.py."""

from __future__ import annotations

import asyncio
import gc
import random

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

from .conftest import SIM_KEY
from .conftest import duckdb_query as query

DAYS = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04")
DAY1, DAY2 = "2026-11-01", "2026-11-02"


def make_table(db: str, days: dict[str, list[str]], id_type: str = "BIGINT", ids=None) -> None:
    """news_headlines with the given headlines per day (ids 1.. in order, or `ids`)."""
    con = duckdb.connect(db)
    con.execute(
        f"CREATE OR REPLACE TABLE news_headlines (id {id_type}, published_at TIMESTAMPTZ, "
        "headline VARCHAR)"
    )
    n = 0
    for day, texts in days.items():
        for i, text in enumerate(texts):
            rid = ids[n] if ids is not None else n + 1
            con.execute(
                "INSERT INTO news_headlines VALUES (?, CAST(? AS TIMESTAMPTZ) + to_seconds(?), ?)",
                [rid, f"{day} 00:00:00+00", i, text],
            )
            n += 1
    con.close()


def with_duplicates(n: int, distinct: int, seed: int, prefix: str = "h") -> list[str]:
    """n headlines of which `distinct` differ; the repeats are spread at random."""
    rng = random.Random(seed)
    texts = [f"{prefix}{i} shares move on results" for i in range(distinct)]
    texts += [rng.choice(texts) for _ in range(n - distinct)]
    rng.shuffle(texts)
    return texts


def asset(**kw):
    settings = dict(
        name="sentiment",
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=Prompt(template="Headline: {{ headline }}\nAnswer with one of: up, down"),
        output="news_sentiment",
        params={"max_tokens": 5, "temperature": 0},
        partitions_def=DAYS,
        chunk_rows=50,
    )
    return build_llm_batch_asset(**(settings | kw))


def materialize(a, sim, db, key=DAY1, **llm):
    resources = {
        "llm": LLMResource(
            base_url=sim.url,
            api_key=SIM_KEY,
            model="gpt-4o-mini",
            price_input_per_1m=0.15,
            price_output_per_1m=0.60,
            **({"max_attempts": 3} | llm),
        ),
        "warehouse": DuckDBWarehouse(database=db),
    }
    return dg.materialize([a], resources=resources, partition_key=key, raise_on_error=False)


def metadata(result):
    mats = result.asset_materializations_for_node("sentiment")
    return {k: v.value for k, v in mats[-1].metadata.items()}


def received(sim) -> int:
    return sim.stats().get("received", 0)


def rows_of(db, key=DAY1):
    return query(
        db,
        "SELECT o.id, s.headline, o.status, o.response, o.cost_usd, o.prompt_tokens, "
        "o.shared_from, o.request_hash FROM news_sentiment o JOIN news_headlines s USING (id) "
        f"WHERE o.partition_key = '{key}' ORDER BY o.id",
    )


def check_shared(rows) -> None:
    """One paying row per identity; every other row of it names a row that has its answer."""
    by_id = {r[0]: r for r in rows}
    payers = {}
    for rid, _headline, _status, _response, cost, tokens, shared_from, h in rows:
        if shared_from is None:
            assert h not in payers, f"identity {h} paid twice"
            payers[h] = rid
            assert cost > 0 and tokens > 0
    for _rid, headline, status, response, cost, tokens, shared_from, h in rows:
        if shared_from is not None:
            assert cost == 0 and tokens is None
            source = by_id[payers[h]]
            assert (status, response) == (source[2], source[3])
            assert headline == source[1]


# -- within a partition run ------------------------------------------------------------------


def test_forty_percent_duplicates_send_each_distinct_request_once(fresh_sim, tmp_path):
    db = str(tmp_path / "w.duckdb")
    texts = with_duplicates(500, 300, seed=1)
    make_table(db, {DAY1: texts})
    result = materialize(asset(), fresh_sim, db)
    assert result.success
    assert received(fresh_sim) == 300
    rows = rows_of(db)
    assert len(rows) == 500 and {r[2] for r in rows} == {"ok"}
    check_shared(rows)
    assert sum(r[6] is not None for r in rows) == 200
    md = metadata(result)
    assert md["run/requests_deduplicated"] == 200 and md["run/answers_reused"] == 0
    assert md["run/rows_sent"] == 300 and md["partition/rows_ok"] == 500
    paid = sum(r[4] for r in rows)
    assert md["partition/cost_usd"] == pytest.approx(paid)
    saved = sum(next(p[4] for p in rows if p[7] == r[7] and p[6] is None) for r in rows if r[6])
    assert md["run/cost_saved_usd"] == pytest.approx(saved, rel=1e-3)
    # A rerun sends nothing: every row is done.
    again = materialize(asset(), fresh_sim, db)
    assert again.success and received(fresh_sim) == 300
    assert metadata(again)["run/rows_skipped"] == 500


def test_a_failed_leader_fails_its_followers_once_and_a_rerun_retries_the_identity_once(
    fresh_sim, tmp_path
):
    db = str(tmp_path / "w.duckdb")
    texts = with_duplicates(200, 120, seed=2)
    bad = texts[7]
    copies = texts.count(bad)
    texts = [t if t != bad else "REJECT " + t for t in texts] + ["REJECT " + bad] * 3
    make_table(db, {DAY1: texts})
    fresh_sim.configure(fail_marker="REJECT")
    materialize(asset(max_failed_fraction=1.0), fresh_sim, db)
    assert received(fresh_sim) == 120
    failed = query(
        db, "SELECT error_class, shared_from IS NULL FROM news_sentiment WHERE status <> 'ok'"
    )
    assert len(failed) == copies + 3
    assert {f[0] for f in failed} == {"bad_request"}
    assert sum(f[1] for f in failed) == 1  # one was sent; the others share its failure
    materialize(asset(max_failed_fraction=1.0), fresh_sim, db)
    assert received(fresh_sim) == 121  # the identity again, once
    fresh_sim.configure(fail_marker=None)
    materialize(asset(max_failed_fraction=1.0), fresh_sim, db)
    assert received(fresh_sim) == 122
    assert query(db, "SELECT count(*) FROM news_sentiment WHERE status = 'ok'") == [(203,)]


def test_followers_of_answers_no_longer_in_memory_are_found_in_the_table(
    fresh_sim, tmp_path, monkeypatch
):
    """With room for 20 answers in memory, a repeat 300 rows later finds its answer in the
    output table (a lookup of this partition), not by sending again."""
    from batch_llm_assets.warehouses.duckdb_session import DuckDBSession

    monkeypatch.setattr("batch_llm_assets.assets.sharing.RECENT_ANSWERS", 20)
    lookups = []  # a spy on the real lookup: asked only once answers have left memory
    real = DuckDBSession.stored_answers
    monkeypatch.setattr(
        DuckDBSession, "stored_answers", lambda s, *a, **k: lookups.append(1) or real(s, *a, **k)
    )
    db = str(tmp_path / "w.duckdb")
    distinct = [f"h{i} shares move on results" for i in range(300)]
    make_table(db, {DAY1: distinct + distinct[::-1] + distinct})
    # 300 requests, 4 at a time, 20 ms each: the answers are written (1 s apart) while the
    # partition is read, so early ones leave memory before their repeats come.
    fresh_sim.configure(latency_ms=20.0)
    result = materialize(asset(reuse_answers=False), fresh_sim, db, max_concurrency=4)
    assert result.success
    assert received(fresh_sim) == 300
    assert lookups
    rows = rows_of(db)
    assert len(rows) == 900
    check_shared(rows)
    md = metadata(result)
    assert md["run/requests_deduplicated"] + md["run/answers_reused"] == 600


# -- hostile input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("id_type", "ids", "text"),
    [
        # ids that print alike, a slash (the separator of another partition's source), unicode
        ("VARCHAR", ["1", "01", "1.0", " 1", "a/b", "\u0661", "x" * 300, "2"], str),
        ("UUID", [f"00000000-0000-0000-0000-00000000000{i}" for i in range(8)], str),
        ("BLOB", [bytes([i, 0, 255]) for i in range(8)], lambda b: b.hex()),
        ("DECIMAL(18,3)", ["1.000", "1.5", "-0.001", "2", "3", "4", "5", "6"], str),
    ],
)
def test_ids_of_any_type_share_and_name_their_source_as_text(
    fresh_sim, tmp_path, id_type, ids, text
):
    db = str(tmp_path / "w.duckdb")
    texts = ["same headline"] * 6 + ["other headline"] * 2
    make_table(db, {DAY1: texts}, id_type=id_type, ids=ids)
    assert materialize(asset(), fresh_sim, db).success
    assert received(fresh_sim) == 2
    rows = query(
        db,
        "SELECT o.id, s.headline, o.shared_from, o.cost_usd FROM news_sentiment o "
        "JOIN news_headlines s USING (id) ORDER BY o.id",
    )
    assert len(rows) == 8
    for headline in ("same headline", "other headline"):
        group = [r for r in rows if r[1] == headline]
        leaders = [r for r in group if r[2] is None]
        assert len(leaders) == 1
        assert {r[2] for r in group if r[2] is not None} <= {text(leaders[0][0])}
        assert all(r[3] == 0 for r in group if r[2] is not None)


def test_a_partition_of_one_repeated_row_sends_one_request(fresh_sim, tmp_path, monkeypatch):
    """3,000 identical rows: one request, while the followers that wait for it are capped
    (the reader pauses at MAX_WAITING, here 25, until the answer releases them)."""
    monkeypatch.setattr("batch_llm_assets.assets.sharing.MAX_WAITING", 25)
    db = str(tmp_path / "w.duckdb")
    make_table(db, {DAY1: ["same headline"] * 3000})
    fresh_sim.configure(latency_ms=200.0)  # the followers come while the leader is in flight
    result = materialize(asset(chunk_rows=20), fresh_sim, db)
    assert result.success
    assert received(fresh_sim) == 1
    assert query(
        db, "SELECT count(*), count(DISTINCT response), count(shared_from) FROM news_sentiment"
    ) == [(3000, 1, 2999)]
    assert metadata(result)["run/requests_deduplicated"] == 2999


def test_a_lone_surrogate_in_an_answer_is_shared_as_stored(fresh_sim, tmp_path):
    db = str(tmp_path / "w.duckdb")
    make_table(db, {DAY1: with_duplicates(300, 100, seed=5)})
    fresh_sim.configure(surrogate_every=1)
    assert materialize(asset(), fresh_sim, db).success
    assert received(fresh_sim) == 100
    rows = rows_of(db)
    assert len(rows) == 300 and all("\ufffd" in r[3] for r in rows)
    check_shared(rows)


class _SurrogateSession:
    """A real DuckDB session whose rows' text gets a lone surrogate where the table has '@'
    (DuckDB itself only stores valid UTF-8; a Python source can hand one over)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def read_slice(self, source, where, chunk_rows):
        for chunk in self._inner.read_slice(source, where, chunk_rows):
            yield [{**r, "headline": r["headline"].replace("@", "\ud800")} for r in chunk]


def test_a_lone_surrogate_in_a_rows_text_is_one_identity(fresh_sim, tmp_path, monkeypatch):
    from batch_llm_assets.warehouses import duckdb_session

    db = str(tmp_path / "w.duckdb")
    make_table(db, {DAY1: ["odd @ headline"] * 5 + ["odd @@ headline"] * 3 + ["plain"] * 2})
    original = DuckDBWarehouse.session

    def session(self):
        cm = original(self)

        class _Wrapped:
            def __enter__(self_):
                return _SurrogateSession(cm.__enter__())

            def __exit__(self_, *exc):
                return cm.__exit__(*exc)

        return _Wrapped()

    monkeypatch.setattr(DuckDBWarehouse, "session", session)
    assert duckdb_session  # the session wrapped is DuckDB's own
    assert materialize(asset(), fresh_sim, db).success
    assert received(fresh_sim) == 3
    assert query(db, "SELECT count(*), count(shared_from) FROM news_sentiment") == [(10, 7)]


def test_a_failed_lookahead_lookup_left_unread_is_not_logged_as_never_retrieved():
    """The next chunk's lookup fails (as when the warehouse runs out of memory) while the run
    stops: its error is the stopping run's business, not an asyncio 'never retrieved' log. The
    lookup is a function that fails: DuckDB running out of memory at one chosen lookup cannot be
    provoked at will (it was seen at 300,000 rows with a 64 MB memory_limit)."""
    from batch_llm_assets.assets.metadata import RunStats
    from batch_llm_assets.assets.sharing import Sharing
    from batch_llm_assets.engine.requests import ChatRequest

    async def lookup(hashes):
        if hashes != ["h0"]:
            raise RuntimeError("out of memory")
        return {}

    async def chunks():
        for i in range(3):
            yield [ChatRequest(id=i, messages=[{"role": "user", "content": str(i)}])]

    async def run() -> list:
        logged: list = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: logged.append(ctx))
        sharing = Sharing(
            partition_key="p",
            hashes={i: f"h{i}" for i in range(3)},
            writer=None,
            deliver=lambda rows: None,
            lookup=lookup,
            stats=RunStats(),
            stored_may_match=True,
        )
        it = sharing.requests(chunks())
        async for _ in it:  # the first row; meanwhile the next chunk's lookup runs, and fails
            for _ in range(3):
                await asyncio.sleep(0)
            break  # the run stops (a failed write, say)
        await it.aclose()
        del it, sharing
        gc.collect()
        await asyncio.sleep(0)
        return [c for c in logged if "never retrieved" in str(c.get("message"))]

    assert asyncio.run(run()) == []
