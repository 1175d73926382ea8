"""Embedding assets (issue 31) against the simulator over HTTP and DuckDB files: a partition into a
vector column, packing, reuse, a bad row isolated, tpm through the shared limiter. Counted at
the simulator (GET /stats) and in Redis, never timed."""

from __future__ import annotations

import math

import dagster as dg
import duckdb
import pytest
import redis

from batch_llm_assets import DuckDBWarehouse, LLMResource, SourceTable, build_llm_embedding_asset
from batch_llm_assets.demo_data import create_demo_table
from batch_llm_assets.embeddings.run import EMBEDDING_COLUMNS
from batch_llm_assets.engine.limiter import limiter_namespace
from batch_llm_assets.warehouses.duckdb_types import TYPES

from .conftest import SIM_KEY, create_distinct_table
from .conftest import duckdb_query as query
from .test_bigquery import bq, bq_endpoint, dataset, day_ids  # noqa: F401  (fixtures)
from .test_bigquery import query as bq_query
from .test_bigquery import warehouse as bq_warehouse

MODEL = "text-embedding-3-small"
DAYS = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04")
PER_DAY = 300
DAY = "2026-11-01"


@pytest.fixture
def db(tmp_path):
    """news_headlines, 300 distinct headlines a day: each row is a request input of its own."""
    path = str(tmp_path / "w.duckdb")
    create_distinct_table(path, days=3, per_day=PER_DAY)
    return path


def asset(**settings):
    return build_llm_embedding_asset(
        **{
            "name": "emb",
            "source": SourceTable(table="news_headlines", partition_column="published_at"),
            "text": "{{ headline }}",
            "output": "news_embeddings",
            "model": MODEL,
            "dimensions": 32,
            "partitions_def": DAYS,
        }
        | settings
    )


def materialize(a, sim, db, key=DAY, **llm):
    resources = {
        "llm": LLMResource(
            base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini", **({"max_attempts": 3} | llm)
        ),
        "warehouse": DuckDBWarehouse(database=db),
    }
    return dg.materialize([a], resources=resources, partition_key=key, raise_on_error=False)


def metadata(result):
    mats = result.asset_materializations_for_node("emb")
    return {k: v.value for k, v in mats[-1].metadata.items()}


def outcomes(db, key=DAY):
    return dict(
        query(
            db,
            "SELECT coalesce(error_class, status), count(*) FROM news_embeddings "
            f"WHERE partition_key = '{key}' GROUP BY ALL",
        )
    )


def test_a_partition_embeds_into_a_vector_column_in_few_requests_and_a_rerun_sends_nothing(
    fresh_sim, db
):
    result = materialize(asset(), fresh_sim, db, price_as_model="gpt-4o-mini")
    assert result.success
    stats = fresh_sim.stats()
    # Packed: far fewer requests than rows (at most one per 50 rows by default).
    assert stats["embedding_inputs"] == PER_DAY and 50 * stats["embedding_requests"] <= PER_DAY
    [(kind,)] = query(
        db, "SELECT data_type FROM information_schema.columns WHERE column_name = 'embedding'"
    )
    assert kind == "FLOAT[]"
    [(rows, ok, dims, norms, hashes, tokens, cost)] = query(
        db,
        "SELECT count(*), count(*) FILTER (status = 'ok'), min(dimensions) || '/' || "
        "max(len(embedding)), min(list_dot_product(embedding, embedding)) || '/' || "
        "max(list_dot_product(embedding, embedding)), count(DISTINCT request_hash), "
        "sum(prompt_tokens), sum(cost_usd) FROM news_embeddings",
    )
    assert rows == ok == hashes == PER_DAY and dims == "32/32"
    low, high = (float(x) for x in norms.split("/"))
    assert math.isclose(low, 1.0, rel_tol=1e-5) and math.isclose(high, 1.0, rel_tol=1e-5)
    assert tokens == stats["admitted_tokens"]  # the usage, shared among the rows exactly
    assert cost == pytest.approx(tokens * 0.02 / 1e6)  # text-embedding-3-small's list price
    md = metadata(result)
    assert md["model"] == MODEL and md["partition/rows_ok"] == PER_DAY
    # The README's similarity query runs on the result.
    [(best,)] = query(
        db,
        "SELECT max(list_cosine_similarity(a.embedding, b.embedding)) FROM news_embeddings a "
        "JOIN news_embeddings b ON a.id < b.id",
    )
    assert 0 < best <= 1.0 + 1e-6
    again = materialize(asset(), fresh_sim, db)
    assert again.success and metadata(again)["run/rows_skipped"] == PER_DAY
    assert fresh_sim.stats()["received"] == stats["received"]  # nothing sent


def test_a_table_made_when_vectors_were_doubles_is_kept(fresh_sim, db):
    """An output table whose embedding column is DOUBLE[] (the earlier layout) takes float32
    vectors as they are: no schema error, the numbers unchanged."""
    cols = ", ".join(
        f"{c} {'DOUBLE[]' if c == 'embedding' else TYPES[k]}" for c, k in EMBEDDING_COLUMNS
    )
    with duckdb.connect(db) as con:
        con.execute(
            f"CREATE TABLE news_embeddings (id BIGINT, {cols}, PRIMARY KEY (partition_key, id))"
        )
    result = materialize(asset(), fresh_sim, db)
    assert result.success and outcomes(db) == {"ok": PER_DAY}
    [(kind,)] = query(
        db, "SELECT data_type FROM information_schema.columns WHERE column_name = 'embedding'"
    )
    assert kind == "DOUBLE[]"
    # Each number is a float32 widened, exactly: casting to FLOAT and back changes none.
    [(changed,)] = query(
        db,
        "SELECT count(*) FROM news_embeddings "
        "WHERE embedding::FLOAT[]::DOUBLE[] IS DISTINCT FROM embedding",
    )
    assert changed == 0


def test_a_new_partition_reuses_the_stored_vectors_of_the_same_text(fresh_sim, tmp_path):
    path = str(tmp_path / "demo.duckdb")
    create_demo_table(path, days=2, per_day=PER_DAY)  # headlines repeat within and across days
    assert materialize(asset(), fresh_sim, path).success
    first = fresh_sim.stats()["embedding_inputs"]
    [(distinct_first,)] = query(
        path,
        f"SELECT count(DISTINCT headline) FROM news_headlines WHERE published_at < '{DAY}'::DATE + 1",
    )
    assert first == distinct_first  # identical texts are sent once
    [(new_texts,)] = query(
        path,
        "SELECT count(DISTINCT headline) FROM news_headlines WHERE published_at >= '2026-11-02' "
        "AND headline NOT IN (SELECT headline FROM news_headlines WHERE published_at < '2026-11-02')",
    )
    assert materialize(asset(), fresh_sim, path, key="2026-11-02").success
    assert fresh_sim.stats()["embedding_inputs"] - first == new_texts
    [(reused,)] = query(
        path,
        "SELECT count(*) FROM news_embeddings WHERE partition_key = '2026-11-02' "
        "AND shared_from LIKE '2026-11-01/%' AND cost_usd = 0 AND status = 'ok'",
    )
    assert reused > 0
    # Another dimensions is another request identity: nothing is reused.
    assert materialize(asset(dimensions=16, output="emb16"), fresh_sim, path).success
    assert fresh_sim.stats()["embedding_inputs"] - first - new_texts == distinct_first


def test_one_bad_input_in_a_packed_request_fails_alone(fresh_sim, db):
    """A row the provider refuses (a marker it rejects, one over its input limit) makes it refuse
    the whole pack with a 400: the pack is split until the row is alone; its neighbours are
    embedded. A row our tokenizer finds over the limit fails without being sent."""
    con = duckdb.connect(db)
    ids = [
        r[0] for r in con.execute("SELECT id FROM news_headlines ORDER BY id LIMIT 3").fetchall()
    ]
    con.execute("UPDATE news_headlines SET headline = headline || ' POISON' WHERE id = ?", [ids[0]])
    provider_long = " ".join(f"w{i}" for i in range(60))  # over the provider's 40, under ours
    con.execute("UPDATE news_headlines SET headline = ? WHERE id = ?", [provider_long, ids[1]])
    ours_long = " ".join(f"w{i}" for i in range(300))  # over max_input_tokens: never sent
    con.execute("UPDATE news_headlines SET headline = ? WHERE id = ?", [ours_long, ids[2]])
    con.close()
    fresh_sim.configure(fail_marker="POISON", embedding_max_input_tokens=40)
    a = asset(max_input_tokens=200, max_failed_fraction=0.5)
    result = materialize(a, fresh_sim, db)
    assert result.success
    failed = dict(
        query(db, "SELECT id, error_class FROM news_embeddings WHERE status <> 'ok' ORDER BY id")
    )
    assert failed == {ids[0]: "bad_request", ids[1]: "context_length", ids[2]: "context_length"}
    assert outcomes(db)["ok"] == PER_DAY - 3
    stats = fresh_sim.stats()
    assert stats["embedding_inputs"] == PER_DAY - 3  # every good row embedded once
    # Halving 299 rows down to each bad one: a few dozen requests, not one per row.
    assert stats["received"] <= 40


def test_tokens_per_minute_go_through_the_shared_limiter_pack_by_pack(
    fresh_sim, db, valkey_url, fresh_limiter_state
):
    """Each packed request acquires its rows' tokens from the shared Redis limiter before it
    goes: the ledger of granted tokens holds one entry per request, each the pack's tokens, and
    the provider's bucket (1 s of 60,000 tokens/min) never refuses one."""
    fresh_sim.configure(tpm=60_000, rpm=None)
    a = asset(max_inputs_per_request=40)
    result = materialize(a, fresh_sim, db, tpm=60_000, redis_url=valkey_url)
    assert result.success and outcomes(db) == {"ok": PER_DAY}
    stats = fresh_sim.stats()
    assert stats["embedding_requests"] == math.ceil(PER_DAY / 40)
    assert stats.get("rate_limited", 0) == 0
    r = redis.Redis.from_url(valkey_url)
    try:
        ledger = r.zrange(f"{limiter_namespace(fresh_sim.url, MODEL, SIM_KEY)}:ledger:t", 0, -1)
    finally:
        r.close()
    amounts = [int(m.decode().split(":")[1]) for m in ledger]
    # A request that woke late on a busy host gave its slot back (a negative entry) for a fresh
    # one: net, one grant per request.
    taken, given_back = [a for a in amounts if a > 0], [a for a in amounts if a < 0]
    assert len(taken) - len(given_back) == stats["embedding_requests"]
    assert sum(amounts) == stats["admitted_tokens"] and min(taken) > 40  # whole packs


def test_a_partition_embeds_into_a_bigquery_array_column_and_a_rerun_sends_nothing(
    fresh_sim,
    bq_endpoint,  # noqa: F811
    bq,  # noqa: F811
    dataset,  # noqa: F811
):
    a = asset(
        source=SourceTable(table=f"{dataset}.news_headlines", partition_column="published_at"),
        output=f"{dataset}.news_embeddings",
        warehouse_kind="bigquery",
        chunk_rows=8,  # several pages, several writes
    )
    resources = {
        "llm": LLMResource(base_url=fresh_sim.url, api_key=SIM_KEY, model="gpt-4o-mini"),
        "warehouse": bq_warehouse(bq_endpoint),
    }
    result = dg.materialize([a], resources=resources, partition_key=DAY, raise_on_error=False)
    assert result.success
    table = bq.get_table(f"{dataset}.news_embeddings")
    kinds = {f.name: (f.field_type, f.mode) for f in table.schema}
    assert kinds["embedding"] == ("FLOAT", "REPEATED") and kinds["truncated"][0] == "BOOLEAN"
    rows = bq_query(
        bq,
        f"SELECT id, status, ARRAY_LENGTH(embedding), dimensions FROM `{dataset}`.news_embeddings",
    )
    assert {r[0] for r in rows} == day_ids(DAY)
    assert {r[1:] for r in rows} == {("ok", 32, 32)}
    sent = fresh_sim.stats()["received"]
    again = dg.materialize([a], resources=resources, partition_key=DAY, raise_on_error=False)
    assert again.success and metadata(again)["run/rows_skipped"] == len(rows)
    assert fresh_sim.stats()["received"] == sent


def test_a_spend_cap_holds_each_pack_and_stops_the_rest_budget_exhausted(fresh_sim, db):
    """budget_usd (issue 30) holds a pack's worst case before it goes: the run stops within the
    cap, the unsent rows are recorded budget_exhausted for a rerun with more budget."""
    price = 0.02 / 1e6  # text-embedding-3-small, USD per token
    budget = 3 * 30 * 11 * price  # about three packs of 30 headlines
    a = asset(max_inputs_per_request=30, max_failed_fraction=1.0)
    result = materialize(a, fresh_sim, db, price_as_model="gpt-4o-mini", budget_usd=budget)
    assert not result.success  # a partition the caps stopped fails, naming the cap
    message = result.get_step_failure_events()[0].step_failure_data.error.message
    assert "budget_usd" in message
    got = outcomes(db)
    assert got.get("ok", 0) >= 30 and got.get("budget_exhausted", 0) > 0
    assert sum(got.values()) == PER_DAY
    [(paid,)] = query(db, "SELECT sum(cost_usd) FROM news_embeddings")
    assert paid <= budget and fresh_sim.stats()["admitted_tokens"] * price <= budget
