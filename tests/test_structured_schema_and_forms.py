"""The output_schema and the request it shapes: the Python and YAML forms giving one strict
schema, bad schemas refused when the asset is built (naming the component attribute), answers
validated against it, the request body for each provider kind, the kind read from the URL unless
named, and the simulator answering every form with valid JSON. Helpers and fixtures are
test_structured.py's."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import BaseModel, Field

from batch_llm_assets import LLMResource
from batch_llm_assets.assets.structured import parse_output_schema
from batch_llm_assets.components.llm_batch.component import (
    LlmBatchComponent,
    LlmBatchConfigError,
)
from batch_llm_assets.engine.constraints import NOTE_HEADER
from batch_llm_assets.engine.engine import ChatRequest
from batch_llm_assets.engine.errors import BatchLLMError
from batch_llm_assets.engine.structured import (
    KINDS,
    SCHEMA_MARKER,
    provider_kind,
    shape_request,
    validator,
)

from .conftest import SIM_KEY
from .test_structured import (
    SENTIMENT,
    Analysis,
    asset,
    ssim,  # noqa: F401  (fixture)
)


# -- the spec ---------------------------------------------------------------------------------------
def test_python_and_yaml_forms_give_one_strict_schema():
    yaml_form = parse_output_schema(
        {
            **SENTIMENT,
            "mentions": {"type": "integer", "minimum": 0, "maximum": 5},
            "about_rates": "boolean",
            "tickers": {"type": "list", "items": "string"},
            "details": "object",
            "sector": {
                "type": "enum",
                "values": ["banks", "energy"],
                "nullable": True,
                "description": "null when none applies",
            },
        }
    )
    py_form = parse_output_schema(Analysis)
    assert py_form.columns() == yaml_form.columns()
    assert dict(py_form.columns()) == {
        "label": "string",
        "confidence": "float",
        "mentions": "int",
        "about_rates": "bool",
        "tickers": "list<string>",
        "details": "json",
        "sector": "string",
    }
    schema = py_form.json_schema()
    assert schema["properties"]["sector"] == {
        "anyOf": [{"type": "string", "enum": ["banks", "energy"]}, {"type": "null"}],
        "description": "null when none applies",
    }
    assert yaml_form.json_schema()["properties"]["sector"] == schema["properties"]["sector"]
    assert schema["additionalProperties"] is False
    assert schema["required"] == list(schema["properties"])
    assert schema["properties"]["confidence"] == {"type": "number", "minimum": 0, "maximum": 1}
    assert schema["properties"]["label"]["enum"] == ["positive", "negative", "neutral"]
    assert py_form.descriptions() == {
        "label": "the sentiment",
        "sector": "null when none applies",
    }
    assert not py_form.strict_ok  # a free-form object cannot be strict
    assert parse_output_schema(SENTIMENT).strict_ok


class NanBound(BaseModel):
    score: float = Field(ge=float("nan"))


@pytest.mark.parametrize(
    "schema, message",
    [
        ({"label": "text"}, "output_schema.label: unknown type 'text'"),
        ({"label": {"type": "enum"}}, "output_schema.label: an enum needs values"),
        ({"n": {"type": "number", "minimum": 2, "maximum": 1}}, "minimum is above maximum"),
        ({"n": {"type": "string", "minimum": 0}}, "minimum applies to integer/number only"),
        ({"xs": {"type": "list", "items": "object"}}, "a list needs items"),
        ({"status": "string"}, "'status' clashes with the output column 'status'"),
        # Column names ignore case in DuckDB and BigQuery: refused here, not at run time with
        # the warehouse's raw error.
        ({"Status": "string"}, "'Status' clashes with the output column 'status'"),
        ({"ID": "string"}, "'ID' clashes with the output column 'id'"),
        ({"Partition_Key": "string"}, "clashes with the output column 'partition_key'"),
        ({"label": "string", "LABEL": "integer"}, "'LABEL' clashes with the field 'label'"),
        # A NaN bound passes no answer (every row paid twice, answer and repair, then failed).
        ({"n": {"type": "number", "minimum": float("nan")}}, "minimum must be a finite number"),
        ({"n": {"type": "number", "maximum": float("-inf")}}, "maximum must be a finite number"),
        (NanBound, "minimum must be a finite number, got nan"),
        ({"bad name": "string"}, "Invalid output_schema field name"),
        ({"label\n": "string"}, "Invalid output_schema field name"),  # matched in full
        ({}, "output_schema has no fields"),
    ],
)
def test_a_bad_output_schema_is_refused_when_the_asset_is_built(schema, message):
    with pytest.raises(BatchLLMError, match=message):
        asset(schema)


def test_output_schema_errors_name_the_component_attribute():
    with pytest.raises(LlmBatchConfigError, match=r"output_schema\.label: an enum needs values"):
        LlmBatchComponent(
            name="sentiment",
            source={"table": "news_headlines", "partition_column": "published_at"},
            prompt={"template": "Headline: {{ headline }}"},
            output="news_sentiment",
            output_schema={"label": {"type": "enum", "values": []}},
        )
    with pytest.raises(BatchLLMError, match=r"params\.response_format: output_schema is set"):
        asset(params={"response_format": {"type": "json_object"}})


def test_answers_are_validated_against_the_schema():
    spec = parse_output_schema(Analysis)
    good = {
        "label": "neutral",
        "confidence": 1,
        "mentions": 2,
        "about_rates": False,
        "tickers": ["AAPL"],
        "details": {"k": 1},
        "sector": None,
    }
    assert spec.parse(json.dumps(good))["confidence"] == 1.0
    assert spec.parse(json.dumps(good | {"sector": "banks"}))["sector"] == "banks"
    assert spec.row_values(json.dumps(good))["details"] == '{"k": 1}'
    for change, problem in [
        ({"label": "bullish"}, '"label" was "bullish"; it must be one of \'positive\''),
        ({"confidence": 1.5}, '"confidence" was 1.5; it must be <= 1'),
        ({"mentions": "2"}, '"mentions" was "2"; it must be an integer'),
        ({"extra": 1}, '"extra" is not a field of the answer'),
        ({"sector": "tech"}, '"sector" was "tech"'),
    ]:
        with pytest.raises(ValueError, match=problem):
            spec.parse(json.dumps(good | change))
    with pytest.raises(ValueError, match="not valid JSON"):
        spec.parse('{"label": "neu')
    assert set(spec.row_values("nope").values()) == {None}


# -- request shaping --------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("kind", KINDS)
def test_the_request_body_for_each_provider_kind(kind):
    schema = parse_output_schema(SENTIMENT).json_schema()
    given = {"temperature": 0, "response_format": {"type": "text"}}
    params, messages = shape_request(kind, schema, MESSAGES, given, name="sentiment answer")
    assert given == {"temperature": 0, "response_format": {"type": "text"}}  # not changed
    assert params["temperature"] == 0
    if kind in ("openai", "azure", "gemini", "ollama"):
        assert params["response_format"] == {
            "type": "json_schema",
            "json_schema": {"name": "sentiment_answer", "schema": schema, "strict": True},
        }
    elif kind == "vllm":
        assert params["structured_outputs"] == {"json": schema}
        assert "response_format" not in params
    elif kind == "llamacpp":
        assert params["response_format"] == {"type": "json_object", "schema": schema}
    else:
        assert params["response_format"] == {"type": "json_object"}
    if kind == "generic":  # the schema is stated in the system prompt instead
        assert messages[0]["content"].startswith("Be brief.\n\n" + SCHEMA_MARKER)
        assert json.loads(messages[0]["content"].split(SCHEMA_MARKER)[1]) == schema
        assert MESSAGES[0]["content"] == "Be brief." and NOTE_HEADER not in messages[0]["content"]
    else:  # the form constrains decoding unseen: the schema's bounds are stated instead
        assert messages[0]["content"] == (
            "Be brief.\n\n" + NOTE_HEADER + '\n- label: one of "positive", "negative", '
            '"neutral"\n- confidence: number in [0, 1] - 0 to 1'
        )
        assert messages[1:] == MESSAGES[1:] and MESSAGES[0]["content"] == "Be brief."


@pytest.mark.parametrize(
    "url, api_version, provider, kind",
    [
        ("https://api.openai.com/v1", None, None, "openai"),
        ("https://acme.openai.azure.com", "2024-10-21", None, "azure"),
        ("https://generativelanguage.googleapis.com/v1beta/openai", None, None, "gemini"),
        # A port or a host name decides nothing: the server is asked (test_server_detect.py).
        ("http://localhost:11434/v1", None, None, "generic"),
        ("http://vllm.internal:8000/v1", None, None, "generic"),
        ("http://llama-server:8080/v1", None, None, "generic"),
        ("http://10.0.0.5:9000/v1", None, None, "generic"),
        ("http://10.0.0.5:9000/v1", None, "llama.cpp", "llamacpp"),
        ("https://api.openai.com/v1", None, "vLLM", "vllm"),
    ],
)
def test_the_provider_kind_comes_from_the_url_unless_named(url, api_version, provider, kind):
    assert provider_kind(url, api_version=api_version, provider=provider) == kind


@pytest.mark.parametrize(
    "kind, transport", [(k, "aiohttp") for k in KINDS] + [("vllm", "openai"), ("openai", "openai")]
)
def test_the_simulator_answers_every_form_with_valid_json(ssim, kind, transport):  # noqa: F811
    spec = parse_output_schema(Analysis)
    params, messages = shape_request(
        kind, spec.json_schema(), MESSAGES, {"max_tokens": 120}, strict=spec.strict_ok
    )
    llm = LLMResource(base_url=ssim.url, api_key=SIM_KEY, model="gpt-4o-mini", transport=transport)

    async def one():
        async with llm.engine() as engine:
            req = ChatRequest(1, messages, params=params, validate=validator(spec.parse))
            return await engine.run_one(req)

    result = asyncio.run(one())
    assert result.ok, result.error_message
    assert set(spec.parse(result.response)) == set(spec.names)
