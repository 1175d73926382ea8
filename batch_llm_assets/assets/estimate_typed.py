"""The size of a typed answer whose every field is bounded, before any answer is stored.

A label, a score or a flag is answered in a few tokens whatever max_tokens allows; an
estimate at max_tokens would be an upper bound several times the bill. When every field of the
output schema is an enum, a number, an integer or a boolean, the answer's size is known from
the schema: the JSON of a typical answer (each enum's middle-length value, each number its
range's midpoint to two decimals, each integer its midpoint, booleans false), counted by the
tokenizer. A free-text field (a string, a list, an object) has no such size: None.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

from ..engine.tokens import count_text_tokens
from .structured import FieldSpec, OutputSchema

_BOUNDED = frozenset({"enum", "number", "integer", "boolean"})


def _typical(f: FieldSpec) -> Any:
    if f.kind == "enum":
        values = sorted(f.values, key=lambda v: len(json.dumps(v)))
        return values[len(values) // 2]
    if f.kind == "boolean":
        return False
    low = f.minimum if f.minimum is not None else 0.0
    high = f.maximum if f.maximum is not None else max(low, 1.0)
    mid = statistics.fmean((low, high))
    return round(mid) if f.kind == "integer" else round(mid, 2)


def bounded_answer_tokens(schema: OutputSchema | None, model: str) -> int | None:
    """Tokens of a typical answer when every field is bounded (see the module), else None."""
    if schema is None or not schema.fields or any(f.kind not in _BOUNDED for f in schema.fields):
        return None
    answer = {f.name: _typical(f) for f in schema.fields}
    return count_text_tokens(json.dumps(answer), model)
