"""Typed outputs a small model can meet (issue 29): the schema's bounds in the system prompt, a
repair turn that quotes the failing value and its bound, and a breaker for rows failing alike.

The simulator over HTTP plays the small model behind a grammar-constraining server: in
`out_of_range` mode it answers valid JSON with numbers outside the schema's bounds unless the
conversation states them (it obeys what it can read); in `ignores_schema` mode it answers prose,
or copies the schema back when the prompt states it. Hostile schemas are checked on the pure
request shaping (what would be sent), with no server needed.
"""

from __future__ import annotations

import asyncio
import json

import dagster as dg
import pytest

from batch_llm_assets import DuckDBWarehouse, LLMResource, Prompt, SourceTable
from batch_llm_assets import build_llm_batch_asset as build
from batch_llm_assets.assets.structured import parse_output_schema
from batch_llm_assets.demo_data import create_demo_table
from batch_llm_assets.engine import _constants as C
from batch_llm_assets.engine.engine import ChatRequest
from batch_llm_assets.engine.structured import repair_messages, shape_request, validator

from .conftest import SIM_KEY, duckdb_query

DAYS = dg.DailyPartitionsDefinition(start_date="2026-11-01", end_date="2026-11-04")
DAY = "2026-11-02"
PER_DAY = 12
SYSTEM = "You are a financial analyst."
SENTIMENT = {
    "label": {"type": "enum", "values": ["positive", "negative", "neutral"]},
    "confidence": {
        "type": "number",
        "minimum": 0,
        "maximum": 1,
        "description": "how sure the label is",
    },
}
CONFIDENCE_LINE = "- confidence: number in [0, 1] - how sure the label is"


@pytest.fixture
def tsim(fresh_sim):
    """The simulator with its structured-output faults off, and its typed mode reset after."""
    off = dict(invalid_json=0.0, truncated_json=0.0, refuse=0.0, reject_json_schema=False)
    fresh_sim.configure(**off)
    yield fresh_sim
    fresh_sim.configure(**off, typed_mode="obeys")


@pytest.fixture
def db(tmp_path):
    path = str(tmp_path / "w.duckdb")
    create_demo_table(path, days=3, per_day=PER_DAY)
    return path


def asset(**kw):
    settings = dict(
        name="sentiment",
        source=SourceTable(
            table="news_headlines", partition_column="published_at", columns=["headline"]
        ),
        prompt=Prompt(system=SYSTEM, template="Headline: {{ headline }}"),
        output="news_sentiment",
        params={"max_tokens": 400},
        partitions_def=DAYS,
        output_schema=SENTIMENT,
    )
    return build(**(settings | kw))


def run(a, sim, db, *, provider, **llm):
    resource = LLMResource(
        base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini", provider=provider, **llm
    )
    return dg.materialize(
        [a],
        resources={"llm": resource, "warehouse": DuckDBWarehouse(database=db)},
        partition_key=DAY,
        raise_on_error=False,
    )


def rows(db, columns):
    return duckdb_query(db, f"SELECT {columns} FROM news_sentiment ORDER BY id")


def failure_message(result) -> str:
    return result.get_step_failure_events()[0].step_failure_data.error.message


# -- the bounds in the prompt ---------------------------------------------------------------------
@pytest.mark.parametrize("provider", ["llamacpp", "vllm", "openai"])
def test_out_of_range_values_drop_when_the_bounds_are_in_the_prompt(tsim, db, provider):
    """Grammar and json_schema forms: the model never reads the schema. Without the bounds in
    the prompt every row answers confidence 10, 100 or 1.2 and fails invalid_output; with them,
    every first answer is in range (no repair, one request per row)."""
    tsim.configure(typed_mode="out_of_range")
    result = run(asset(repair_attempts=0), tsim, db, provider=provider)
    got = rows(db, "status, error_class, attempts, confidence")
    assert {(s, c, n) for s, c, n, _ in got} == {("ok", None, 1)}, got[:3]
    assert result.success and all(0 <= conf <= 1 for *_, conf in got)
    stats = tsim.stats(messages=True)
    assert stats["answered"] == PER_DAY
    system = stats["recent_messages"][-1][0]["content"]
    assert system.startswith(SYSTEM) and system.endswith(CONFIDENCE_LINE)
    assert '- label: one of "positive", "negative", "neutral"' in system


# -- the repair turn ------------------------------------------------------------------------------
def _unstated_request(rid, spec, kind="llamacpp", repair_attempts=1):
    """A typed request in `kind`'s form whose prompt does not state the bounds (as a caller's
    own shaping, or a bound the note could not hold, would send)."""
    params, _ = shape_request(kind, spec.json_schema(), [], {"max_tokens": 200})
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Headline {rid}: rates are up"},
    ]
    return ChatRequest(
        rid,
        messages,
        params=params,
        validate=validator(spec.parse),
        repair_attempts=repair_attempts,
    )


def _engine_run(sim, requests, **llm):
    resource = LLMResource(
        base_url=sim.url, api_key=SIM_KEY, model="gpt-4o-mini", provider="llamacpp", **llm
    )

    async def go():
        async with resource.engine() as engine:
            out = [r async for r in engine.map(requests)]
            return out, engine.aborted_reason

    return asyncio.run(go())


def test_the_repair_turn_quotes_the_failing_value_and_its_bound(tsim):
    tsim.configure(typed_mode="out_of_range")
    spec = parse_output_schema(SENTIMENT)
    (result,), aborted = _engine_run(tsim, [_unstated_request(1, spec)])
    assert aborted is None
    # The first answer was out of range; the repair, which states the bound, is in range.
    assert result.ok and result.attempts == 2, result.error_message
    assert 0 <= json.loads(result.response)["confidence"] <= 1
    first, repair = tsim.stats(messages=True)["recent_messages"][-2:]
    assert repair[: len(first)] == first
    bad = json.loads(repair[-2]["content"])["confidence"]  # the answer handed back
    assert bad > 1
    said = repair[-1]["content"]
    assert f'"confidence" was {json.dumps(bad)}; it must be <= 1' in said, said
    assert len(said) < 300


def test_a_runaway_answer_is_not_sent_back_whole():
    spec = parse_output_schema(SENTIMENT)
    huge = json.dumps({"label": "x" * 1_000_000, "confidence": 0.5})
    with pytest.raises(ValueError) as caught:
        spec.parse(huge)
    problem = str(caught.value)
    assert problem.startswith('"label" was "xxxx') and "it must be one of" in problem
    assert len(problem) <= 3 * C.REPAIR_VALUE_MAX_CHARS
    follow = repair_messages([{"role": "user", "content": "Hi"}], huge, problem)
    assert sum(len(m["content"]) for m in follow) < C.REPAIR_ANSWER_MAX_CHARS + 500


# -- the breaker ----------------------------------------------------------------------------------
def test_rows_failing_the_same_bound_trip_the_breaker_naming_it(tsim):
    """No repair, no bound in the prompt: each row fails at confidence's maximum; the fifth in a
    row stops the run, and the rows after it are not sent."""
    tsim.configure(typed_mode="out_of_range")
    spec = parse_output_schema(SENTIMENT)
    requests = [_unstated_request(i, spec, repair_attempts=0) for i in range(8)]
    results, aborted = _engine_run(tsim, requests, max_concurrency=1)
    assert aborted is not None
    assert aborted.startswith(
        f'{C.BREAKER_THRESHOLD} consecutive rows failed validation at "confidence" (maximum 1)'
    )
    assert "it must be <= 1" in aborted
    classes = [r.error_class for r in sorted(results, key=lambda r: r.id)]
    assert classes == ["invalid_output"] * C.BREAKER_THRESHOLD + ["aborted"] * 3
    assert tsim.stats()["received"] == C.BREAKER_THRESHOLD


@pytest.mark.parametrize(
    "provider, why",
    [
        ("generic", 'at "label" (required)'),  # the schema copied back: valid JSON, no fields
        ("llamacpp", "(the answers are not valid JSON)"),  # prose
    ],
)
def test_a_model_ignoring_the_schema_trips_the_breaker_after_one_repair_per_row(
    tsim, db, provider, why
):
    tsim.configure(typed_mode="ignores_schema")
    result = run(asset(), tsim, db, provider=provider, max_concurrency=1)
    assert not result.success
    n = C.BREAKER_THRESHOLD
    message = failure_message(result)
    assert f"{n} consecutive rows failed validation {why}" in message, message
    got = rows(db, "status, error_class, attempts, error")
    assert [(s, c, a) for s, c, a, _ in got] == [("failed", "invalid_output", 2)] * n + [
        ("failed", "aborted", 0)
    ] * (PER_DAY - n)
    assert all(why in e for *_, e in got[n:])
    # One repair per failed row, nothing for the rows after the trip: no loop, no third payment.
    stats = tsim.stats()
    assert stats["received"] == stats["answered"] == 2 * n


def test_a_valid_row_in_between_starts_the_count_again(tsim):
    """Alike failures must be consecutive: after a valid row, it takes n more to trip."""
    spec = parse_output_schema(SENTIMENT)
    tsim.configure(typed_mode="out_of_range")
    n = C.BREAKER_THRESHOLD
    bad = [_unstated_request(i, spec, repair_attempts=0) for i in range(n - 1)]
    good = _unstated_request(99, spec, repair_attempts=0)
    good.messages[0]["content"] += "\nconfidence: a number from 0 to 1"  # stated by the caller
    more = [_unstated_request(100 + i, spec, repair_attempts=0) for i in range(n + 1)]
    results, aborted = _engine_run(tsim, [*bad, good, *more], max_concurrency=1)
    assert aborted is not None and aborted.startswith(f"{n} consecutive rows failed validation")
    assert [r.error_class for r in results] == (
        ["invalid_output"] * (n - 1) + [None] + ["invalid_output"] * n + ["aborted"]
    )
    assert tsim.stats()["received"] == 2 * n


# -- hostile schemas ------------------------------------------------------------------------------
def _system(kind, schema):
    _, messages = shape_request(
        kind, schema, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}], {}
    )
    return messages[0]["content"]


def _note_is_bounded(system):
    note = system.removeprefix(SYSTEM)
    assert "must meet these constraints" in note
    assert len(note) <= C.SCHEMA_NOTE_MAX_CHARS + 200
    note.encode("utf-8")  # valid Unicode: no lone surrogate reaches the request body
    return note


def test_a_schema_of_a_thousand_fields_and_a_megabyte_of_descriptions_makes_a_short_note():
    props = {
        f"f{i}": {"type": "number", "maximum": i, "description": "d" * 1000} for i in range(1000)
    }
    note = _note_is_bounded(_system("llamacpp", {"type": "object", "properties": props}))
    lines = note.strip().splitlines()
    assert lines[1].startswith("- f0: number <= 0 (optional) - ddd")
    assert lines[-1] == "- (more constraints not listed)"
    assert len(lines) <= C.SCHEMA_NOTE_MAX_LINES + 2


def test_nesting_refs_odd_names_and_long_enums_stay_bounded():
    deep: dict = {"type": "integer", "minimum": 1}
    for i in range(400):  # deeper than the note reads: no recursion error, a bounded note
        deep = {"type": "object", "description": f"level {i}", "properties": {f"n{i}": deep}}
    cycle = {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {"next": {"$ref": "#/$defs/Node"}, "w": {"maximum": 3}},
            }
        },
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/Node"}},
    }
    odd = {
        "type": "object",
        "properties": {
            "\ud800bad\nname": {"type": "string", "maxLength": 5, "description": "x\ud83d"},
            "tags": {"type": "array", "maxItems": 3, "items": {"enum": list(range(10_000))}},
            "big": {"type": "integer", "maximum": 10**5000},
        },
        "required": ["tags"],
    }
    for schema in (deep, cycle, odd):
        _note_is_bounded(_system("vllm", schema))
    assert _system("vllm", deep).endswith("- (more constraints not listed)")
    note = _note_is_bounded(_system("openai", odd))
    assert '- ["\ufffdbad\\nname"]: string of at most 5 characters (optional) - x\ufffd' in note
    assert "- tags: list of at most 3 items" in note
    assert "- tags[]: one of 0, 1, 2" in note and "more)" in note
    assert "big" not in note  # a bound no number can reach is not stated
    assert "- root.w: number <= 3 (optional)" in _system("vllm", cycle)


@pytest.mark.parametrize("bound", [float("nan"), float("inf")])
def test_a_non_finite_bound_is_a_clear_error_before_anything_is_sent(bound):
    schema = {"type": "object", "properties": {"confidence": {"type": "number", "minimum": bound}}}
    with pytest.raises(ValueError, match=r"minimum of 'confidence' is (nan|inf); a bound must be"):
        _system("llamacpp", schema)


# -- the identity ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["live", "batch"])
def test_a_new_note_or_form_sends_no_stored_typed_row_again(tsim, db, monkeypatch, mode):
    """A typed row's identity is what is asked (the rendered messages and the schema), not the
    provider's form of it nor the note stating the schema's bounds: rows stored before an
    upgrade that words the note differently, or before the server was detected as another
    kind, are done, not paid again."""
    from batch_llm_assets.assets.batch_mode import BatchSettings
    from batch_llm_assets.assets.structured import OutputSchema

    from .test_batch_mode import batch_config

    batch_config(tsim, completion_s=0.2, line_fail=0.0, expire_fraction=None)
    kw = {"mode": "batch", "batch": BatchSettings(poll_first_s=0.2, poll_max_s=0.5)}
    make = (lambda: asset(**kw)) if mode == "batch" else asset
    assert run(make(), tsim, db, provider="llamacpp").success
    assert duckdb_query(db, "SELECT count(*) FROM news_sentiment WHERE status = 'ok'") == [
        (PER_DAY,)
    ]
    monkeypatch.setattr(OutputSchema, "_note", "- confidence: a number from 0 to 1")
    tsim.reset()
    assert run(make(), tsim, db, provider="llamacpp").success
    stats = tsim.stats()
    assert (stats.get("received", 0), stats.get("batches_created", 0)) == (0, 0)
    # Nor does another form of asking for the schema: the server detected as vLLM this time.
    assert run(make(), tsim, db, provider="vllm").success
    stats = tsim.stats()
    assert (stats.get("received", 0), stats.get("batches_created", 0)) == (0, 0)


def test_rows_stored_under_the_exact_body_before_are_done(tsim, db, monkeypatch):
    """Rows stored when a typed row's identity was the exact body sent (form and note
    included) are recognised: the upgrade to the form-free identity pays for nothing again."""
    from batch_llm_assets.assets import reader

    key = reader.SliceReader._render

    def exact_body_identity(self, chunk, done):  # the identity of the earlier releases
        for req in key(self, chunk, done):
            if req.body is not None:
                self.hashes[req.id] = reader.request_identity(req.body, self.scopes[0])
            yield req

    monkeypatch.setattr(reader.SliceReader, "_render", exact_body_identity)
    assert run(asset(), tsim, db, provider="llamacpp").success
    monkeypatch.undo()
    tsim.reset()
    assert run(asset(), tsim, db, provider="llamacpp").success
    assert tsim.stats().get("received", 0) == 0
