"""Honest outcomes: every answer shape gets its status, partitions are judged as they stand,
metadata separates the partition from the run, no key fragment leaks. Request identity is in
test_request_identity.py.

All against the simulator over HTTP and DuckDB files; the simulator's answer-shape settings
(simulator/answers.py) stand in for the providers that return them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import dagster as dg
import duckdb
import pytest

from batch_llm_assets import (
    ChatRequest,
    DuckDBWarehouse,
    LLMResource,
    Prompt,
    SourceTable,
    build_llm_batch_asset,
)
from batch_llm_assets.demo_data import create_demo_table
from batch_llm_assets.engine.errors import BatchLLMError, redact
from batch_llm_assets.engine.outcome import classify_answer, tools_requested
from batch_llm_assets.engine.transport import parse_completion

from .conftest import SIM_KEY, duckdb_query

DAYS = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-03")
LABELS = Prompt(template="Headline: {{ headline }}\nAnswer with one of: positive, negative")
DAY = "2026-11-01"


def asset(**kw):
    settings = dict(
        name="sentiment",
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=LABELS,
        output="news_sentiment",
        partitions_def=DAYS,
        max_failed_fraction=1.0,
    )
    return build_llm_batch_asset(**(settings | kw))


def run(a, sim, db, *, instance=None, **llm):
    resources = {
        "llm": LLMResource(
            base_url=llm.pop("base_url", sim.url),
            api_key=llm.pop("api_key", SIM_KEY),
            model="gpt-4o-mini",
            # The simulator plays a hosted API here: a fixed 64 in flight, as the figures assume.
            **({"max_attempts": 3, "adaptive_concurrency": False} | llm),
        ),
        "warehouse": DuckDBWarehouse(database=db),
    }
    return dg.materialize(
        [a], resources=resources, partition_key=DAY, raise_on_error=False, instance=instance
    )


def metadata(result):
    (mat,) = result.asset_materializations_for_node("sentiment")
    return {k: v.value for k, v in mat.metadata.items()}


def partition_part(md):
    return {k: v for k, v in md.items() if k.startswith("partition/") or k == "dagster/row_count"}


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "o.duckdb")
    create_demo_table(path, days=1, per_day=12)
    return path


# --- answer shapes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,error_class,finish",
    [
        ("null_content", "refusal", "stop"),
        ("refusal", "refusal", "stop"),
        ("content_filter", "content_filter", "content_filter"),
        ("length", "truncated", "length"),
        ("tool_calls", "unexpected_tool_call", "tool_calls"),
    ],
)
def test_an_incomplete_answer_is_failed_with_its_reason_and_resent(
    fresh_sim, db, shape, error_class, finish
):
    fresh_sim.configure(**{f"answer_{shape}": 1.0})
    result = run(asset(), fresh_sim, db)
    assert result.success  # max_failed_fraction=1: the rows are judged, the run is not
    rows = duckdb_query(
        db,
        "SELECT DISTINCT status, error_class, finish_reason, refusal IS NOT NULL, "
        "response IS NOT NULL AND response <> '' FROM news_sentiment",
    )
    assert rows == [("failed", error_class, finish, shape == "refusal", shape == "length")]
    if shape == "length":  # the partial text is kept; the message says what to change
        (msg,) = {r[0] for r in duckdb_query(db, "SELECT error FROM news_sentiment")}
        assert "raise max_tokens" in msg
    md = metadata(result)
    assert md["partition/rows_failed"] == 12 and md["partition/rows_ok"] == 0
    # Not done: a rerun sends them again instead of skipping them.
    assert metadata(run(asset(), fresh_sim, db))["run/rows_sent"] == 12
    assert fresh_sim.stats()["answered"] == 24


def test_rows_failed_before_sending_are_not_counted_as_sent(fresh_sim, tmp_path):
    """`run/rows_sent` is what reached the provider: empty prompts (NULL columns) are not."""
    db = str(tmp_path / "empty.duckdb")
    create_demo_table(db, days=1, per_day=2000)
    con = duckdb.connect(db)
    con.execute("UPDATE news_headlines SET headline = NULL WHERE id % 1000 <> 0")
    con.close()
    md = metadata(run(asset(), fresh_sim, db))
    assert fresh_sim.stats().get("received", 0) == 2
    assert (md["run/rows_sent"], md["run/rows_ok"], md["run/rows_failed"]) == (2, 2, 1998)
    assert "2 sent; 2 ok, 1998 failed (1998 of them before sending)" in md["summary"]


def test_tool_calls_that_were_asked_for_are_the_answer(fresh_sim, db):
    fresh_sim.configure(answer_tool_calls=1.0)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    assert run(asset(params={"tools": tools}), fresh_sim, db).success
    rows = duckdb_query(db, "SELECT DISTINCT status, finish_reason FROM news_sentiment")
    assert rows == [("ok", "tool_calls")]
    (response,) = duckdb_query(db, "SELECT response FROM news_sentiment LIMIT 1")[0]
    assert '"name": "lookup"' in response


def test_empty_choices_are_retried_once_not_max_attempts_times(fresh_sim, db):
    fresh_sim.configure(answer_empty_choices=1.0)
    result = run(asset(), fresh_sim, db, max_attempts=6)
    assert fresh_sim.stats()["answered"] == 24  # two billable answers per row, not six
    rows = duckdb_query(db, "SELECT DISTINCT status, error_class, attempts FROM news_sentiment")
    assert rows == [("failed", "malformed_response", 2)]
    assert "empty_choices" in duckdb_query(db, "SELECT error FROM news_sentiment LIMIT 1")[0][0]
    assert metadata(result)["partition/rows_failed"] == 12


# --- the partition as it stands ------------------------------------------------------------------


def test_a_rerun_that_changes_nothing_leaves_a_green_partition_green(fresh_sim, tmp_path):
    db = str(tmp_path / "p.duckdb")
    create_demo_table(db, days=1, per_day=300)
    con = duckdb.connect(db)
    con.execute("UPDATE news_headlines SET headline = headline || ' ZZFAIL' WHERE id % 30 = 0")
    con.close()
    fresh_sim.configure(fail_marker="ZZFAIL")  # those 10 prompts always get a 400
    a = asset(max_failed_fraction=0.05)
    with dg.instance_for_test() as instance:
        # Priced explicitly: the simulator is a local server, which costs nothing by default.
        priced = {"price_input_per_1m": 0.15, "price_output_per_1m": 0.6}
        first, second = (run(a, fresh_sim, db, instance=instance, **priced) for _ in range(2))
        assert first.success and second.success  # 10 of 300 failed (3.3 %), both times
        one, two = metadata(first), metadata(second)
        assert one["partition/rows_failed"] == two["partition/rows_failed"] == 10
        assert two["run/rows_sent"] == 10 and two["run/rows_skipped"] == 290
        assert partition_part(one) == partition_part(two)  # the plots stay flat
        assert one["partition/cost_usd"] == two["partition/cost_usd"] > 0
        checks = {e.check_name: e for e in second.get_asset_check_evaluations()}
        assert not checks["failed_fraction"].passed  # over the 1 % warning threshold ...
        assert checks["failed_fraction"].severity == dg.AssetCheckSeverity.WARN  # ... a warning
        assert checks["row_count_matches_input"].passed


def test_metadata_labels_carry_units_and_cost_is_a_number_or_absent(fresh_sim, db):
    result = run(asset(), fresh_sim, db)
    md = result.asset_materializations_for_node("sentiment")[0].metadata
    units = ("_s", "_ms", "_usd", "_tokens", "_fraction", "_per_min", "_429", "retries")
    for key, value in md.items():
        if key.startswith(("partition/", "run/")):
            # A count names what it counts first: rows_, requests_, answers_.
            counts = ("rows_", "requests_", "answers_")
            assert key.split("/")[1].startswith(counts) or key.endswith(units), key
            assert isinstance(value.value, int | float), key
    assert "run/cost_usd" not in md  # a local server, not priced: absent, never 0
    second = metadata(run(asset(), fresh_sim, db))
    assert second["run/rows_sent"] == 0 and second["run/rows_skipped"] == 12
    assert "run/latency_p50_ms" not in second  # nothing was sent: no latency, not 0 ms
    assert second["partition/rows_ok"] == 12


# --- latency and limiter wait ---------------------------------------------------------------------


def test_total_time_includes_retries_and_limiter_wait_is_wall_time(fresh_sim, valkey_url):
    # A key of its own: the limiter's namespace (base_url + model + key) is this test's alone.
    key = f"sk-{uuid.uuid4().hex}"
    fresh_sim.configure(api_key=None, fail_503=0.4)
    llm = LLMResource(
        base_url=fresh_sim.url, api_key=key, model="gpt-4o-mini", rpm=1200, redis_url=valkey_url
    )
    messages = [{"role": "user", "content": "Answer with one of: a, b"}]

    async def go():
        async with llm.engine() as engine:
            started = time.monotonic()
            results = [r async for r in engine.map(ChatRequest(i, messages) for i in range(40))]
            return results, engine.limiter_wait_s, time.monotonic() - started

    results, wait_s, wall_s = asyncio.run(go())
    retried = [r for r in results if r.ok and r.attempts > 1]
    assert retried and all(r.total_ms >= r.latency_ms + 300 for r in retried)  # >= one backoff
    assert all(r.total_ms >= r.latency_ms for r in results if r.ok)
    per_row_sum = sum(r.rate_limit_wait_s for r in results)
    assert 0 < wait_s <= wall_s < per_row_sum  # wall time while anyone waited, not a sum


# --- redaction ---------------------------------------------------------------------------------

SECRET = "sk-proj/Ab+Cd=Ef0123456789XyZ-tail"


def fragments(text: str) -> list[str]:
    return [SECRET[i : i + 8] for i in range(len(SECRET) - 7) if SECRET[i : i + 8] in text]


def test_redact_removes_every_run_of_eight_key_characters():
    from urllib.parse import quote

    for echoed in (SECRET[-12:], SECRET[6:20], quote(SECRET, safe=""), '{"k": "' + SECRET + '"}'):
        out = redact(f"Invalid token {echoed} for org", SECRET)
        assert not fragments(out) and quote(SECRET, safe="")[8:20] not in out, out
        assert out.startswith("Invalid token ") and out.endswith(" for org")
    assert redact("no secret here at all", SECRET) == "no secret here at all"


@pytest.mark.parametrize(
    "echo,status", [("suffix", 401), ("middle", 401), ("urlencoded", 400), ("json", 400)]
)
def test_no_key_fragment_reaches_logs_metadata_or_the_table(
    fresh_sim, db, capfd, caplog, echo, status
):
    if status == 401:  # the provider rejects our key and echoes it back
        fresh_sim.configure(key_echo=echo)
    else:  # a 400 that quotes the (accepted) key
        fresh_sim.configure(api_key=SECRET, key_echo=echo, fail_400_key_echo=1.0)
    with dg.instance_for_test() as instance:
        result = run(
            asset(max_failed_fraction=0.05), fresh_sim, db, api_key=SECRET, instance=instance
        )
        assert not result.success
        events = "\n".join(dg.serialize_value(e) for e in instance.all_logs(result.run_id))
        # Everything the instance stored: run and event storage, captured compute logs.
        stored = "\n".join(
            p.read_bytes().decode("latin-1")
            for p in Path(instance.root_directory).rglob("*")
            if p.is_file()
        )
    table = duckdb_query(
        db,
        "SELECT string_agg(coalesce(error, '') || coalesce(response, ''), '|') FROM news_sentiment",
    )
    errors = duckdb_query(db, "SELECT DISTINCT error_class FROM news_sentiment")
    assert errors and {e[0] for e in errors} <= {"authentication", "aborted", "bad_request"}
    captured = capfd.readouterr()
    texts = {
        "event log": events,
        "instance storage": stored,
        "stdout/stderr": captured.out + captured.err,
        "python logs": caplog.text,
        "table": str(table),
    }
    assert "partition/rows_failed" in stored  # the storage is readable text: the scan can see
    echoed = "Invalid token" in str(table) or "Incorrect API key" in str(table)
    assert echoed and "***" in str(table)  # the message was kept, the key taken out
    for where, text in texts.items():
        assert not fragments(text), f"{where} holds {fragments(text)}"


# --- parameters that break one row, one answer ------------------------------------------------


@pytest.mark.parametrize("params,name", [({"n": 2}, "n"), ({"stream": True}, "stream")])
def test_parameters_that_break_one_answer_per_row_are_refused_at_load(params, name):
    with pytest.raises(BatchLLMError, match=rf"params\.{name}: is"):
        asset(params=params)
    asset(params={"n": 1, "stream": False})  # the defaults are fine


def test_parse_and_classify_read_the_choice_and_message_shapes():
    def verdict(message, finish="stop", body=None):
        payload = {"choices": [{"message": message, "finish_reason": finish}], "usage": {}}
        resp = parse_completion(payload, {})
        return classify_answer(resp, tools_allowed=tools_requested(body or {}), max_tokens=9)

    assert verdict({"content": "up"}).ok
    assert verdict({"content": "   "}).error_class == "empty_answer"
    assert verdict({"content": "u"}, "length").error_class == "truncated"
    legacy = {"content": None, "function_call": {"name": "f", "arguments": "{}"}}
    assert verdict(legacy, "function_call").error_class == "unexpected_tool_call"
    assert verdict(legacy, "function_call", {"functions": [{"name": "f"}]}).ok
    refused = {"content": None, "refusal": "no"}
    assert verdict(refused, "content_filter").error_class == "refusal"  # its words are kept
    empty = parse_completion({"choices": [], "usage": {"prompt_tokens": 3}}, {})
    assert empty.empty_choices and empty.prompt_tokens == 3  # billable: counted, retried once
    assert classify_answer(empty, tools_allowed=False, max_tokens=9).retry
