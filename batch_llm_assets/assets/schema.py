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
    ("model", "string"),
    ("prompt_tokens", "int"),
    ("completion_tokens", "int"),
    ("cost_usd", "float"),
    ("latency_ms", "float"),
    ("attempts", "int"),
    ("request_hash", "string"),
    ("completed_at", "timestamp"),
)

_DESCRIPTIONS = {
    "id": "the source row's id (one output row per input id)",
    "status": "ok or failed",
    "response": "the answer's raw text (with output_schema: the JSON the fields come from)",
    "error_class": "why a row failed (empty_prompt, context_length, rate_limited, "
    "invalid_output, refusal, ...)",
    "request_hash": "sha256 of prompt + model + params: a rerun skips ok rows with the same hash",
    "cost_usd": "NULL when the model's price is unknown",
}


def output_table(name: str, typed: tuple[tuple[str, str], ...] = ()) -> OutputTable:
    """`typed`: the typed-output columns (assets/structured.py), appended after the fixed ones."""
    return OutputTable(name=name, columns=OUTPUT_COLUMNS + tuple(typed))


def output_schema(id_column: str) -> dg.TableSchema:
    cols = [dg.TableColumn("id", "same as source", description=_DESCRIPTIONS["id"])]
    cols += [dg.TableColumn(c, t, description=_DESCRIPTIONS.get(c)) for c, t in OUTPUT_COLUMNS]
    return dg.TableSchema(columns=cols)
