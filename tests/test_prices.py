"""Model prices: exact matches (never a base model's price), dated snapshots, cached input tokens
and the batch discount, checked against genai-prices' own figures; local servers not priced,
configured prices, one warning for an unknown model or a different served model. Split from
test_dg.py."""

from __future__ import annotations

import logging

import genai_prices
import pytest

from batch_llm_assets.assets import cost_usd, price_for
from batch_llm_assets.assets.pricing import served_model


def library_cost(model: str, **usage: int) -> float:
    return float(
        genai_prices.calc_price(
            genai_prices.Usage(**usage), model, provider_id="openai"
        ).total_price
    )


@pytest.mark.parametrize(
    "model, base", [("o3-pro", "o3"), ("gpt-5-pro", "gpt-5"), ("gpt-4o-mini", "gpt-4o")]
)
def test_prices_match_models_exactly(model, base):
    exact, other = price_for(model), price_for(base)
    assert exact is not None and other is not None
    assert exact.input_per_1m != other.input_per_1m  # not priced as its base model
    assert exact.input_per_1m == library_cost(model, input_tokens=1_000_000)


def test_prices_of_a_dated_snapshot_cached_tokens_and_batch():
    snapshot, base = price_for("gpt-4o-mini-2024-07-18"), price_for("gpt-4o-mini")
    assert snapshot is not None and base is not None
    assert snapshot.input_per_1m == base.input_per_1m
    full = cost_usd(base, 10_000, 100)
    cached = cost_usd(base, 10_000, 100, cached=8_000)
    assert cached == pytest.approx(
        library_cost("gpt-4o-mini", input_tokens=10_000, cache_read_tokens=8_000, output_tokens=100)
    )
    assert cached < full
    batch = price_for("gpt-4o-mini", batch=True)
    assert batch is not None and batch.input_per_1m < base.input_per_1m


def test_prices_of_local_servers_configured_and_unknown_models(caplog):
    # A local server is not priced (None: "not priced", never a cost of 0).
    assert price_for("gpt-4o-mini", base_url="http://127.0.0.1:8000/v1") is None
    assert price_for("llama-3", base_url="http://gpu-box:8000/v1", provider="vllm") is None
    # A hosted profile behind a local gateway is billed.
    assert price_for("gpt-4o-mini", base_url="http://localhost:4000", provider="openai").source == (
        "genai-prices"
    )
    mine = price_for("sim-1", input_override=1.0, output_override=2.0)
    assert cost_usd(mine, 1_000_000, 1_000_000) == pytest.approx(3.0)
    logger = logging.getLogger("test_dg.prices")
    with caplog.at_level(logging.WARNING, logger="test_dg.prices"):
        assert price_for("no-such-model-xyz", logger=logger) is None
        assert price_for("no-such-model-xyz", logger=logger) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "price_input_per_1m" in warnings[0]  # once, saying how


def test_a_different_served_model_warns_once(caplog):
    logger = logging.getLogger("test_dg.served")
    with caplog.at_level(logging.WARNING, logger="test_dg.served"):
        seen = served_model("gpt-4o-mini", "gpt-4o-mini-2024-07-18", None, logger)  # a snapshot
        assert seen == "gpt-4o-mini-2024-07-18" and not caplog.records
        seen = served_model("gpt-4o-mini", "llama-3-8b", seen, logger)
        seen = served_model("gpt-4o-mini", "llama-3-8b", seen, logger)
    assert seen == "llama-3-8b" and len(caplog.records) == 1
