"""Embeddings in batch mode: /v1/embeddings lines through the simulator's Batch API, at the batch
price, exactly once across a SIGKILL (as tests/test_batch_mode.py checks the chat batch mode),
with DuckDB files and real `dagster asset materialize` subprocesses; counted at the simulator."""

from __future__ import annotations

import pytest

from batch_llm_assets.assets.batch_mode import BatchSettings, state_table_for

from .conftest import SIM_KEY, materialize_argv
from .conftest import duckdb_query as query
from .test_batch_mode import bsim, kill_while_polling_then_rerun  # noqa: F401  (fixture)
from .test_embeddings import DAY, MODEL, PER_DAY, asset, db, materialize, metadata  # noqa: F401


def batch_asset(**settings):
    return asset(mode="batch", batch=BatchSettings(poll_first_s=0.2, poll_max_s=0.5), **settings)


def test_a_batch_partition_is_embedded_at_half_price_and_a_rerun_sends_nothing(
    bsim,  # noqa: F811
    db,  # noqa: F811
):
    result = materialize(batch_asset(), bsim, db, price_as_model="gpt-4o-mini")
    assert result.success
    stats = bsim.stats()
    assert (stats["batches_created"], stats["batch_lines_submitted"]) == (1, PER_DAY)
    assert stats.get("received", 0) == 0  # nothing through the live route
    [(rows, ok, dims, tokens, cost)] = query(
        db,
        "SELECT count(*), count(*) FILTER (status = 'ok'), min(len(embedding)), "
        "sum(prompt_tokens), sum(cost_usd) FROM news_embeddings",
    )
    assert (rows, ok, dims) == (PER_DAY, PER_DAY, 32)
    assert cost == pytest.approx(tokens * 0.02 / 1e6 * 0.5)  # half the live list price
    md = metadata(result)
    assert md["mode"] == "batch" and md["batch_price_factor"] == 0.5
    # The same text gives the same vector as in live mode: the rows' hashes are the live ones.
    live = materialize(asset(output="live_embeddings"), bsim, db)
    assert live.success
    [(same,)] = query(
        db,
        "SELECT count(*) FROM news_embeddings b JOIN live_embeddings l USING (id) "
        "WHERE b.request_hash = l.request_hash AND b.embedding = l.embedding",
    )
    assert same == PER_DAY
    again = materialize(batch_asset(), bsim, db)
    assert again.success and metadata(again)["run/rows_skipped"] == PER_DAY
    assert bsim.stats()["batches_created"] == 1


_DEFS = """
import dagster as dg
from batch_llm_assets import DuckDBWarehouse, LLMResource, SourceTable, build_llm_embedding_asset
from batch_llm_assets.assets.batch_mode import BatchSettings

emb = build_llm_embedding_asset(
    name="emb",
    source=SourceTable(table="news_headlines", partition_column="published_at"),
    text="{{{{ headline }}}}",
    output="news_embeddings",
    model="{model}",
    dimensions=32,
    partitions_def=dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04"),
    mode="batch",
    batch=BatchSettings(poll_first_s=0.2, poll_max_s=0.5),
)
defs = dg.Definitions(assets=[emb], resources={{
    "llm": LLMResource(base_url="{url}", api_key="{key}", model="gpt-4o-mini"),
    "warehouse": DuckDBWarehouse(database="{db}"),
}})
"""


def test_sigkill_while_waiting_then_rerun_embeds_the_partition_exactly_once(
    bsim,  # noqa: F811
    db,  # noqa: F811
    tmp_path,
):
    defs = tmp_path / "defs.py"
    defs.write_text(_DEFS.format(model=MODEL, url=bsim.url, key=SIM_KEY, db=db))
    cmd, env = materialize_argv(defs, tmp_path / "home", select="emb", partition=DAY)
    kill_while_polling_then_rerun(bsim, cmd, env)
    stats = bsim.stats()
    assert (stats["files_uploaded"], stats["batches_created"]) == (1, 1)
    assert stats["batch_lines_submitted"] == PER_DAY == stats["batch_lines_processed"]
    assert stats["embedding_inputs"] == PER_DAY  # each text embedded once
    assert query(
        db, "SELECT count(*), count(DISTINCT id), min(status), max(status) FROM news_embeddings"
    ) == [(PER_DAY, PER_DAY, "ok", "ok")]
    state = state_table_for("news_embeddings")
    assert query(db, f"SELECT state FROM {state}") == [("collected",)]
