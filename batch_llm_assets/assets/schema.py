"""The output table's columns: one row per input id, whatever the warehouse."""

from __future__ import annotations

import dagster as dg

from ..warehouses.base import OutputTable

OUTPUT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("partition_key", "string"),
    ("response", "string"),
    ("status", "string"),
    ("error_class", "string"),
    ("error", "string"),
    ("finish_reason", "string"),
    ("refusal", "string"),
    ("model", "string"),
    ("prompt_tokens", "int"),
    ("completion_tokens", "int"),
    ("cost_usd", "float"),
    ("latency_ms", "float"),
    ("total_ms", "float"),
    ("attempts", "int"),
    ("request_hash", "string"),
    ("completed_at", "timestamp"),
    ("shared_from", "string"),
    ("service_tier", "string"),
)

_DESCRIPTIONS = {
    "id": "the source row's id (one output row per input id)",
    "response": "the answer's raw text (with output_schema: the JSON the fields come from); "
    "for a truncated row the partial text",
    "status": "ok (a complete answer) or failed",
    "error_class": "why a row failed: truncated, content_filter, refusal, unexpected_tool_call, "
    "empty_answer, malformed_response, invalid_output, empty_prompt, context_length, rate_limited, ...",
    "finish_reason": "the provider's finish_reason (stop, length, content_filter, tool_calls)",
    "refusal": "the model's refusal message, when it refused",
    "request_hash": "sha256 of the exact request body sent (model, max_tokens, params, messages; "
    "for typed outputs the rendered messages and the schema, in no provider's form) and the "
    "endpoint's scope, numbers normalised: a rerun skips ok rows whose hash is unchanged",
    "cost_usd": "NULL when the model's price is unknown; 0 for a row whose answer was shared",
    "shared_from": "set when the row was not sent but took the answer of an identical request "
    "(same request_hash): the id (as text) of the row it took it from, prefixed by "
    "'<partition_key>/' when that row is in another partition; its tokens are NULL",
    "service_tier": "the processing tier the answer says served it (flex, default), when the "
    "request asked for one; a flex row is priced at flex prices, one flex_fallback sent at the "
    "standard tier at standard prices",
    "latency_ms": "the successful attempt's time",
    "total_ms": "first send to final result, retries and waits included",
}


def output_table(name: str, typed: tuple[tuple[str, str], ...] = ()) -> OutputTable:
    """`typed`: the typed-output columns (assets/structured.py), appended after the fixed ones."""
    return OutputTable(name=name, columns=OUTPUT_COLUMNS + tuple(typed))


def output_schema(id_column: str) -> dg.TableSchema:
    cols = [dg.TableColumn("id", "same as source", description=_DESCRIPTIONS["id"])]
    cols += [dg.TableColumn(c, t, description=_DESCRIPTIONS.get(c)) for c, t in OUTPUT_COLUMNS]
    return dg.TableSchema(columns=cols)
