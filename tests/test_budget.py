"""Spend caps (issue 30): budget_usd per run and budget_usd_per_day per job_key hold. The
simulator counts what was sent and answers with real usage; DuckDB holds what each row cost;
the day's spend is shared through real Redis/Valkey by real separate processes."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import uuid
from datetime import UTC, datetime

import dagster as dg
import pytest
import redis
from pydantic import ValidationError

from batch_llm_assets import ChatRequest, DuckDBWarehouse, LLMResource
from batch_llm_assets.engine.budget import DailyLedger, day_keys, nano
from batch_llm_assets.engine.errors import BatchLLMError
from batch_llm_assets.engine.tokens import count_prompt_tokens

from .conftest import SIM_KEY
from .conftest import duckdb_query as query
from .test_batch_mode import PER_DAY, bsim  # noqa: F401  (fixture)
from .test_batch_mode import asset as batch_asset
from .test_sharing import DAY1, asset, make_table, materialize, received

PRICE_IN, PRICE_OUT = 0.15, 0.60  # USD per 1M tokens, as test_sharing's resource sets them
MAX_TOKENS = 40
TEMPLATE = "Headline: {headline}\nAnswer with one of: up, down"


def headlines(n: int, prefix: str = "h") -> list[str]:
    return [f"{prefix}{i} shares move on results of quarter {i % 7}" for i in range(n)]


def prompt_costs(texts: list[str], template: str = TEMPLATE) -> list[float]:
    """Each row's prompt in USD, as the engine counts it: less than the row costs."""
    out = []
    for text in texts:
        messages = [{"role": "user", "content": template.format(headline=text)}]
        out.append(count_prompt_tokens(messages, "gpt-4o-mini") * PRICE_IN / 1e6)
    return out


def worst_cases(
    texts: list[str], template: str = TEMPLATE, max_tokens: int = MAX_TOKENS
) -> list[float]:
    """Each row's worst case in USD: its prompt and `max_tokens` out."""
    return [p + max_tokens * PRICE_OUT / 1e6 for p in prompt_costs(texts, template)]


def priced_llm(sim, **settings) -> LLMResource:
    return LLMResource(
        base_url=sim.url,
        api_key=SIM_KEY,
        model="gpt-4o-mini",
        price_input_per_1m=PRICE_IN,
        price_output_per_1m=PRICE_OUT,
        **settings,
    )


def capped_asset():
    return asset(params={"max_tokens": MAX_TOKENS, "temperature": 0})


def statuses(db: str) -> dict[str, int]:
    rows = query(
        db, "SELECT coalesce(error_class, status), count(*) FROM news_sentiment GROUP BY 1"
    )
    return dict(rows)


def spent(db: str) -> float:
    return query(db, "SELECT coalesce(sum(cost_usd), 0) FROM news_sentiment")[0][0]


def failure(result):
    event = result.get_step_failure_events()[0].step_failure_data
    metadata = {k: v.value for k, v in event.user_failure_data.metadata.items()}
    return event.error.message, metadata


# -- per run --------------------------------------------------------------------------------------


def test_half_the_estimate_stops_near_the_budget_and_a_rerun_pays_only_the_rest(
    fresh_sim, tmp_path
):
    texts = headlines(300)
    worst = worst_cases(texts)
    # The estimate: what the same rows cost, run uncapped on another table.
    reference = str(tmp_path / "reference.duckdb")
    make_table(reference, {DAY1: texts})
    assert materialize(capped_asset(), fresh_sim, reference).success
    budget = round(spent(reference) / 2, 6)
    assert budget > 10 * max(worst)
    fresh_sim.reset()
    db = str(tmp_path / "w.duckdb")
    make_table(db, {DAY1: texts})
    result = materialize(capped_asset(), fresh_sim, db, budget_usd=budget)
    assert not result.success
    counts = statuses(db)
    assert counts["ok"] + counts["budget_exhausted"] == 300 and counts["budget_exhausted"] > 0
    paid = spent(db)
    # Stopped near the budget: the next request's worst case did not fit, nothing of the run's
    # own was in flight (its answers cost less than held: it waited for them).
    assert budget - max(worst) < paid <= budget
    assert received(fresh_sim) == counts["ok"]
    message, md = failure(result)
    assert "budget_usd" in message and f"${budget:.6f}".rstrip("0") in message
    assert "spent" in message and "Raise budget_usd on the LLM resource" in message
    assert md["run/budget_usd"] == pytest.approx(budget)
    assert md["run/budget_spent_usd"] == pytest.approx(paid, abs=1e-6)
    assert md["partition/rows_ok"] == counts["ok"]

    again = materialize(capped_asset(), fresh_sim, db, budget_usd=budget * 4)
    assert again.success
    assert statuses(db) == {"ok": 300}
    stats = fresh_sim.stats()
    assert received(fresh_sim) == 300 and stats["resent_prompts"] == 0  # no ok row paid twice


def test_a_budget_below_one_request_sends_nothing_and_says_so(fresh_sim, tmp_path):
    db = str(tmp_path / "w.duckdb")
    texts = headlines(20)
    make_table(db, {DAY1: texts})
    budget = min(worst_cases(texts)) / 2
    result = materialize(capped_asset(), fresh_sim, db, budget_usd=budget)
    assert not result.success
    assert received(fresh_sim) == 0
    assert statuses(db) == {"budget_exhausted": 20}
    assert "the next request may cost up to" in failure(result)[0]


def test_a_budget_on_an_unpriced_model_is_a_configuration_error(fresh_sim, tmp_path):
    """The simulator is a local server: not priced unless prices are set."""
    db = str(tmp_path / "w.duckdb")
    make_table(db, {DAY1: headlines(10)})
    llm = LLMResource(base_url=fresh_sim.url, api_key=SIM_KEY, model="gpt-4o-mini", budget_usd=5)
    result = dg.materialize(
        [capped_asset()],
        resources={"llm": llm, "warehouse": DuckDBWarehouse(database=db)},
        partition_key=DAY1,
        raise_on_error=False,
    )
    assert not result.success
    message = result.get_step_failure_events()[0].step_failure_data.error.message
    assert "not priced" in message and "price_input_per_1m" in message
    assert received(fresh_sim) == 0


def test_chat_batch_of_a_resource_with_a_budget_is_refused_before_sending(fresh_sim):
    """chat_batch does not price its requests: a cap over them could not hold."""
    llm = priced_llm(fresh_sim, budget_usd=1.0)

    async def main():
        request = ChatRequest(1, [{"role": "user", "content": "hello"}])
        return [r async for r in llm.chat_batch([request])]

    with pytest.raises(BatchLLMError, match="chat_batch and engine\\(\\) do not price"):
        asyncio.run(main())
    assert received(fresh_sim) == 0


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), -1.0, 0, 0.0, "5", "abc", True, [5], 1e12],
    ids=[
        "nan",
        "inf",
        "negative",
        "zero",
        "zero-float",
        "numeric-str",
        "str",
        "bool",
        "list",
        "huge",
    ],
)
@pytest.mark.parametrize("name", ["budget_usd", "budget_usd_per_day"])
def test_hostile_budgets_are_refused_naming_the_setting(name, value):
    with pytest.raises(ValidationError) as err:
        LLMResource(redis_url="redis://127.0.0.1:6379/11", **{name: value})
    assert name in str(err.value) and "USD" in str(err.value)


def test_a_daily_budget_needs_a_shared_redis():
    with pytest.raises(ValidationError, match="budget_usd_per_day needs redis_url"):
        LLMResource(budget_usd_per_day=5.0)
    assert LLMResource(budget_usd=0.5, budget_usd_per_day=5, redis_url="redis://h/0").budget_usd


# -- per day, across processes -----------------------------------------------------------------


def _process_main(sim_url, redis_url, db, job, cap, queue):
    """One run of one partition under the day's cap, in a process of its own."""
    llm = {"redis_url": redis_url, "job_key": job, "budget_usd_per_day": cap}
    sim = type("Sim", (), {"url": sim_url})  # what materialize reads of the simulator
    result = materialize(capped_asset(), sim, db, **llm)
    queue.put((db, result.success))


def test_four_processes_under_one_daily_budget_overshoot_by_at_most_a_request_each(
    fresh_sim, tmp_path, redis_url
):
    job = f"test-{uuid.uuid4().hex[:8]}"
    dbs, worst, prompts = [], [], []
    for i in range(4):
        db = str(tmp_path / f"p{i}.duckdb")
        texts = headlines(400, prefix=f"p{i}-")
        make_table(db, {DAY1: texts})
        dbs.append(db)
        worst += worst_cases(texts)
        prompts.append(sum(prompt_costs(texts)))
    # Half of what the prompts of any one process cost: each alone would run out, so every
    # one stops on the cap, the last with nothing of the others held.
    cap = round(min(prompts) / 2, 6)
    assert cap > 10 * max(worst)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_process_main, args=(fresh_sim.url, redis_url, db, job, cap, queue))
        for db in dbs
    ]
    for p in procs:
        p.start()
    outcomes = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert set(outcomes.values()) == {False}  # every run failed on the cap
    total = sum(spent(db) for db in dbs)
    ok = sum(statuses(db).get("ok", 0) for db in dbs)
    assert total <= cap + 4 * max(worst)
    # ... and stopped near it (amounts are rounded up to 1e-9 USD per request). Not within one
    # worst case: a process's refusal can come while requests of its own that took their holds
    # just before are in flight, and they settle below their worst case after it stopped.
    assert total > cap - 4 * max(worst) - ok * 1e-9
    assert received(fresh_sim) == ok
    assert all(statuses(db).get("budget_exhausted", 0) > 0 for db in dbs)
    r = redis.Redis.from_url(redis_url)
    try:
        for key in day_keys(job, _today()):
            r.delete(key)
    finally:
        r.close()


def _today():
    return datetime.now(UTC).date()


def test_a_hold_left_by_a_killed_process_is_given_back_when_its_lease_ends(redis_url):
    """A process killed between reserve and settle (SIGKILL) never settles: its hold is
    returned by the next call after its lease, so the day's cap does not keep it forever."""
    job = f"test-{uuid.uuid4().hex[:8]}"

    async def main():
        dead = DailyLedger(redis_url, cap_usd=1.0, job=job)
        alive = DailyLedger(redis_url, cap_usd=1.0, job=job)
        await dead.open()
        await alive.open()
        try:
            assert await dead.reserve(nano(0.8), lease_ms=300) is not None  # then "killed"
            assert await alive.reserve(nano(0.5), lease_ms=60_000) is None  # held by the dead
            deadline = asyncio.get_running_loop().time() + 30
            while (hold := await alive.reserve(nano(0.5), lease_ms=60_000)) is None:
                assert asyncio.get_running_loop().time() < deadline, "the hold was never returned"
                await asyncio.sleep(0.05)
            await alive.settle(hold, nano(0.25))
            assert (alive.spent, alive.held) == (nano(0.25), 0)
        finally:
            r = redis.Redis.from_url(redis_url)
            r.delete(*day_keys(job, _today()))
            r.close()
            await dead.aclose()
            await alive.aclose()

    asyncio.run(main())


# -- batch mode ------------------------------------------------------------------------------------


def test_batch_mode_holds_files_within_the_budget_and_a_rerun_finishes_it(bsim, tmp_path):  # noqa: F811
    """A file is held whole or cut to what fits, charged when submitted and refunded to its
    real cost when collected (then the rest may fit); what never fits is budget_exhausted."""

    def run(db, **budget):
        resources = {"llm": priced_llm(bsim, **budget), "warehouse": DuckDBWarehouse(database=db)}
        return dg.materialize(
            [batch_asset()], resources=resources, partition_key=DAY1, raise_on_error=False
        )

    reference, db = str(tmp_path / "reference.duckdb"), str(tmp_path / "w.duckdb")
    texts = headlines(PER_DAY)
    make_table(reference, {DAY1: texts})
    make_table(db, {DAY1: texts})
    assert run(reference).success
    budget = round(spent(reference) / 2, 7)
    bsim.reset()
    result = run(db, budget_usd=budget)
    assert not result.success
    counts = statuses(db)
    assert counts["ok"] + counts["budget_exhausted"] == PER_DAY and counts["budget_exhausted"] > 0
    batch_prompt = "Headline: {headline}\nAnswer with one of: positive, negative, neutral"
    worst = max(worst_cases(texts, batch_prompt, max_tokens=5)) * 0.5  # at the batch price
    assert budget - worst - PER_DAY * 1e-9 < spent(db) <= budget
    assert bsim.stats()["batch_lines_processed"] == counts["ok"]
    assert "budget_usd" in failure(result)[0]

    assert run(db, budget_usd=budget * 4).success
    assert statuses(db) == {"ok": PER_DAY}
    assert bsim.stats()["batch_lines_processed"] == PER_DAY  # no line answered (paid) twice
