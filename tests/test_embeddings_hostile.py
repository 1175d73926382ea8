"""Embedding assets given hostile input: bad texts (NULL, NaN, empty, blank, huge, a lone
surrogate), duplicate ids, bad settings (dimensions 0, negative, NaN, too large). Each ends in
one clear outcome, against the simulator over HTTP and DuckDB files."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import duckdb
import numpy as np
import pandas as pd
import pytest

from batch_llm_assets import LlmBatchConfigError, LLMResource, SourceTable
from batch_llm_assets.embeddings.packing import EmbedItem, PackLimits, sized
from batch_llm_assets.embeddings.sender import EmbeddingSender

from .conftest import SIM_KEY, create_distinct_table
from .conftest import duckdb_query as query
from .test_embeddings import MODEL, PER_DAY, asset, materialize

HUGE = "word " * 2_000_000  # 10 MB


def _table(path, texts):
    """news_headlines with these texts, all in partition DAY, ids 1..n."""
    at = datetime(2026, 11, 1, 12, tzinfo=UTC)
    frame = pd.DataFrame(
        {"id": range(1, len(texts) + 1), "published_at": [at] * len(texts), "headline": texts}
    )
    con = duckdb.connect(path)
    try:
        con.register("frame", frame)
        con.execute("CREATE OR REPLACE TABLE news_headlines AS SELECT * FROM frame")
    finally:
        con.close()


def _errors(path, table="news_embeddings"):
    return dict(query(path, f"SELECT id, coalesce(error_class, status) FROM {table} ORDER BY id"))


def test_null_nan_empty_blank_and_huge_texts_fail_alone_or_are_truncated(fresh_sim, tmp_path):
    path = str(tmp_path / "h.duckdb")
    _table(path, [None, np.nan, "", "   ", HUGE, "Acme beats estimates", "Globex misses"])
    result = materialize(asset(max_failed_fraction=1.0), fresh_sim, path)
    assert result.success
    assert _errors(path) == {
        1: "empty_prompt",
        2: "empty_prompt",
        3: "empty_prompt",
        4: "empty_prompt",
        5: "prompt_too_large",  # over 8 characters per token of the input limit: not tokenized
        6: "ok",
        7: "ok",
    }
    assert fresh_sim.stats()["embedding_inputs"] == 2
    # With truncate, the huge text is cut to the input limit and embedded.
    cut = asset(truncate=True, output="cut", max_failed_fraction=1.0)
    assert materialize(cut, fresh_sim, path).success
    [(status, truncated, tokens, dims)] = query(
        path, "SELECT status, truncated, prompt_tokens, dimensions FROM cut WHERE id = 5"
    )
    assert (status, truncated, dims) == ("ok", True, 32) and 8000 < tokens <= 8192
    assert query(path, "SELECT count(*) FROM cut WHERE truncated")[0][0] == 1


def test_duplicate_ids_fail_the_partition_before_anything_is_sent(fresh_sim, tmp_path):
    path = str(tmp_path / "d.duckdb")
    _table(path, ["a b", "c d", "e f"])
    con = duckdb.connect(path)
    con.execute("UPDATE news_headlines SET id = 1 WHERE id = 2")
    con.close()
    result = materialize(asset(), fresh_sim, path)
    assert not result.success
    message = result.get_step_failure_events()[0].step_failure_data.error.message
    assert "Duplicate ids" in message
    assert fresh_sim.stats().get("received", 0) == 0


@pytest.mark.parametrize("value", [0, -3, float("nan"), True, 10**9, "256", 2.5])
def test_bad_dimensions_are_refused_before_any_run(value):
    with pytest.raises(LlmBatchConfigError) as info:
        asset(dimensions=value)
    assert info.value.description.startswith("dimensions:")


@pytest.mark.parametrize(
    ("settings", "path"),
    [
        ({"text": "{{ body }}"}, "text"),
        ({"text": ""}, "text"),
        ({"encoding_format": "int8"}, "encoding_format"),
        ({"max_inputs_per_request": 0}, "max_inputs_per_request"),
        ({"max_tokens_per_request": -1}, "max_tokens_per_request"),
        ({"max_input_tokens": 0}, "max_input_tokens"),
    ],
)
def test_bad_settings_name_the_setting(settings, path):
    with pytest.raises(LlmBatchConfigError) as info:
        asset(**{"source": _source_with_headline()} | settings)
    assert info.value.description.startswith(path), info.value.description


def _source_with_headline():
    return SourceTable(
        table="news_headlines", partition_column="published_at", columns=["headline"]
    )


def test_dimensions_too_large_for_the_model_stop_the_run_naming_the_reason(fresh_sim, tmp_path):
    """The provider refuses every pack (dimensions over the model's 1536): packs are split,
    the rows fail bad_request with the provider's message, the breaker stops the run after a
    few, and the partition fails saying why."""
    db = str(tmp_path / "w.duckdb")
    create_distinct_table(db, days=1, per_day=PER_DAY)
    result = materialize(asset(dimensions=2000), fresh_sim, db)
    assert not result.success
    message = result.get_step_failure_events()[0].step_failure_data.error.message
    assert "dimensions" in message
    assert fresh_sim.stats()["received"] <= 40  # not one request per row
    assert fresh_sim.stats().get("embedding_inputs", 0) == 0


def test_a_lone_surrogate_and_odd_text_are_sent_and_embedded(fresh_sim):
    """Text a warehouse cannot hold but a template can make (a lone UTF-16 surrogate) goes out
    as JSON escapes and comes back embedded, beside its neighbours in the same request."""
    llm = LLMResource(base_url=fresh_sim.url, api_key=SIM_KEY, model=MODEL)
    limits = PackLimits(max_inputs=10, max_tokens=1000, max_input_tokens=100)
    texts = ["Acme \ud83d rises", "emoji 📈 up", "tab\tand\nnewline", "<|endoftext|> text"]

    async def run():
        async with llm.engine(model=MODEL) as engine:
            sender = EmbeddingSender(engine, limits=limits, dimensions=8, encoding_format="base64")
            items = [sized(EmbedItem(i, t), limits, MODEL) for i, t in enumerate(texts)]
            return await sender.run_pack(items)

    results = asyncio.run(run())
    assert [r.status for r in results] == ["ok"] * 4
    assert all(r.embedding.shape == (8,) for r in results)
    assert fresh_sim.stats()["embedding_requests"] == 1
    assert sum(r.prompt_tokens for r in results) == fresh_sim.stats()["admitted_tokens"]
