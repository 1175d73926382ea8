"""Flex processing (issue 30): `service_tier: flex` at flex prices, its 429 Resource Unavailable
retried without slowing the shared limiter, `flex_fallback: standard`, and a model without flex
refused before sending. Against the simulator over HTTP (simulator/tiers.py); DuckDB holds the
rows, the simulator counts what was sent."""

from __future__ import annotations

import asyncio

import dagster as dg
import pydantic
import pytest

from batch_llm_assets import ChatRequest, DuckDBWarehouse, LLMResource

from .conftest import SIM_KEY
from .conftest import duckdb_query as query
from .test_sharing import DAY1, asset, make_table, metadata, received

MODEL = "gpt-5-mini"  # flex at half its list price: 0.25 / 2.00 -> 0.125 / 1.00 per 1M
STANDARD, FLEX = (0.25, 2.0), (0.125, 1.0)
ROWS = 20
FLEX_PARAMS = {"max_tokens": 5, "temperature": 0, "service_tier": "flex"}


@pytest.fixture
def sim(fresh_sim, monkeypatch):
    """The simulator serving MODEL; flex backoff shortened (its delays are minutes-scale)."""
    fresh_sim.configure(models={"sim-1": 16_384, "gpt-4o-mini": 128_000, MODEL: 400_000})
    monkeypatch.setattr("batch_llm_assets.engine._constants.FLEX_RETRY_DELAY_S", 0.02)
    monkeypatch.setattr("batch_llm_assets.engine._constants.FLEX_MAX_RETRY_DELAY_S", 0.1)
    return fresh_sim


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "w.duckdb")
    make_table(path, {DAY1: [f"h{i} shares move on results" for i in range(ROWS)]})
    return path


def llm(sim, **kw):
    settings = dict(
        base_url=sim.url,
        api_key=SIM_KEY,
        model=MODEL,
        price_as_model=MODEL,
        max_attempts=3,
    )
    return LLMResource(**(settings | kw))


def run(sim, db, params=FLEX_PARAMS, **kw):
    resources = {"llm": llm(sim, **kw), "warehouse": DuckDBWarehouse(database=db)}
    a = asset(params=params)
    return dg.materialize([a], resources=resources, partition_key=DAY1, raise_on_error=False)


def rows(db):
    return query(
        db,
        "SELECT status, error_class, error, service_tier, attempts, cost_usd, prompt_tokens, "
        "completion_tokens FROM news_sentiment ORDER BY id",
    )


def priced(rate, prompt, completion):
    return (prompt * rate[0] + completion * rate[1]) / 1e6


def test_flex_rows_are_priced_at_flex_prices_with_the_longer_timeout(sim, db):
    assert llm(sim).engine_settings(params=FLEX_PARAMS).request_timeout_s == 900.0
    assert llm(sim).engine_settings().request_timeout_s < 900.0
    result = run(sim, db)
    assert result.success and received(sim) == ROWS
    for status, _, _, tier, attempts, cost, pt, ct in rows(db):
        assert (status, tier, attempts) == ("ok", "flex", 1)
        assert cost == pytest.approx(priced(FLEX, pt, ct))
    md = metadata(result)
    total = query(db, "SELECT sum(prompt_tokens), sum(completion_tokens) FROM news_sentiment")
    assert md["run/cost_usd"] == pytest.approx(priced(FLEX, *total[0]), abs=1e-6)


def test_a_flex_shortage_is_retried_until_capacity_comes_back(sim, db):
    sim.configure(flex_unavailable=0.5)
    result = run(sim, db, max_attempts=12)
    assert result.success
    refused = sim.stats()["flex_unavailable"]
    assert refused > 0 and received(sim) == ROWS + refused
    got = rows(db)
    assert {(r[0], r[3]) for r in got} == {("ok", "flex")}
    assert sum(r[4] - 1 for r in got) == refused  # each refusal was one more attempt of a row
    assert metadata(result)["run/http_429"] == 0  # not counted as rate limiting


def test_flex_fallback_sends_the_row_at_the_standard_tier_priced_so(sim, db):
    sim.configure(flex_unavailable=1.0)
    result = run(sim, db, max_attempts=2, flex_fallback="standard")
    assert result.success
    assert sim.stats()["flex_unavailable"] == 2 * ROWS and received(sim) == 3 * ROWS
    for status, _, _, tier, attempts, cost, pt, ct in rows(db):
        assert (status, tier, attempts) == ("ok", "default", 3)
        assert cost == pytest.approx(priced(STANDARD, pt, ct))


def test_without_fallback_a_lasting_shortage_fails_the_rows_after_their_attempts(sim, db):
    sim.configure(flex_unavailable=1.0)
    result = run(sim, db, max_attempts=3)
    assert not result.success
    assert sim.stats()["flex_unavailable"] == 3 * ROWS == received(sim)  # no more, no loop
    for status, error_class, error, tier, attempts, cost, _, _ in rows(db):
        assert (status, error_class, attempts, tier, cost) == (
            "failed",
            "resource_unavailable",
            3,
            None,
            None,
        )
        assert "Resource Unavailable" in error and "flex_fallback" in error


def test_flex_shortages_do_not_slow_the_shared_limiter(
    sim, valkey_url, fresh_limiter_state, first_grant
):
    sim.configure(flex_unavailable=0.5)
    resource = llm(sim, rpm=60_000, redis_url=valkey_url, max_attempts=12, params=FLEX_PARAMS)

    async def go():
        async with resource.engine() as engine:
            prompts = [f"h{i} shares move. Answer with one of: up, down" for i in range(ROWS)]
            reqs = [ChatRequest(i, [{"role": "user", "content": p}]) for i, p in enumerate(prompts)]
            results = [r async for r in engine.map(reqs)]
            return results, engine.limiter.factor, engine.limiter.epoch - first_grant[0].epoch

    results, factor, epoch = asyncio.run(go())
    assert sim.stats()["flex_unavailable"] > 0
    assert all(r.ok and r.service_tier == "flex" for r in results)
    assert sum(r.http_429 for r in results) == 0
    assert (factor, epoch) == (1.0, 0)  # no overload event: the rate was never lowered


def test_flex_for_a_model_without_it_is_refused_before_sending(sim, db):
    result = run(sim, db, model="gpt-4o-mini", price_as_model=None)
    assert not result.success and received(sim) == 0
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "not offered for 'gpt-4o-mini'" in str(failure.event_specific_data.error)


def test_switching_an_asset_to_flex_sends_nothing_again(sim, db):
    standard = {k: v for k, v in FLEX_PARAMS.items() if k != "service_tier"}
    assert run(sim, db, params=standard).success and received(sim) == ROWS
    again = run(sim, db)  # the same requests at flex: already answered
    assert again.success and received(sim) == ROWS
    assert metadata(again)["run/rows_skipped"] == ROWS


def test_a_service_tier_that_is_not_a_name_or_a_bad_fallback_is_refused(sim):
    with pytest.raises(pydantic.ValidationError, match="flex_fallback"):
        llm(sim, flex_fallback="premium")

    async def go(params):
        async with llm(sim, params=params).engine():
            pass

    for bad in (5, float("nan"), "", ["flex"]):
        with pytest.raises(ValueError, match="params"):
            asyncio.run(go({"service_tier": bad}))  # one error naming the params
    assert received(sim) == 0
