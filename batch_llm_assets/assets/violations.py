"""What is wrong with an answer, as the rule it broke (engine/constraints.Violation).

Pydantic's error details name the error type, the location, the input and, in `ctx`, the bound
(https://docs.pydantic.dev/latest/errors/validation_errors/): `less_than_equal` with
`ctx={"le": 1}` is JSON Schema's `maximum` 1. The repair turn then says `"confidence" was 10; it
must be <= 1`, and the breaker compares field and rule across rows.
"""

from __future__ import annotations

import json
from typing import Any

from ..engine.constraints import Violation, broken, unparsable

# pydantic error type -> (JSON Schema keyword, the ctx key holding the bound)
_RULES = {
    "less_than_equal": ("maximum", "le"),
    "less_than": ("exclusiveMaximum", "lt"),
    "greater_than_equal": ("minimum", "ge"),
    "greater_than": ("exclusiveMinimum", "gt"),
    "multiple_of": ("multipleOf", "multiple_of"),
    "string_too_short": ("minLength", "min_length"),
    "string_too_long": ("maxLength", "max_length"),
    "too_short": ("minItems", "min_length"),
    "too_long": ("maxItems", "max_length"),
    "string_pattern_mismatch": ("pattern", "pattern"),
    "literal_error": ("enum", "expected"),
    "enum": ("enum", "expected"),
}
# pydantic type errors (strict mode) -> what the value must be
_TYPES = {
    "float_type": "a number",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "a list",
    "dict_type": "a JSON object",
    "model_type": "a JSON object",
    "finite_number": "a finite number",
}


def json_object(text: str | None) -> dict[str, Any]:
    """The answer's JSON object; a Violation when it is empty, not JSON, or not an object."""
    if text is None or not text.strip():
        raise unparsable("the answer is empty, expected a JSON object")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise unparsable(f"the answer is not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(doc, dict):
        raise broken((), "type", bound="a JSON object", value=doc)
    return doc


def violation(error: Any) -> Violation:
    """The Violation of one of pydantic's `ValidationError.errors()` entries."""
    kind = str(error.get("type", ""))
    loc = tuple(p for p in error.get("loc", ()) if isinstance(p, str | int))
    value = error.get("input")
    if kind == "missing":
        return broken(loc, "required")
    if kind == "extra_forbidden":
        return broken(loc, "additionalProperties")
    if kind in _TYPES:
        return broken(loc, "type", bound=_TYPES[kind], value=value)
    if kind in _RULES:
        rule, ctx_key = _RULES[kind]
        bound = (error.get("ctx") or {}).get(ctx_key)
        return broken(loc, rule, bound=bound, value=value, detail=str(error.get("msg", "")))
    return broken(loc, kind or "invalid", value=value, detail=str(error.get("msg", "")))
