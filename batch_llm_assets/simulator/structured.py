"""The simulator's structured outputs: answer a schema request with JSON generated from it.

Every form a client may send is read: `response_format` json_schema (OpenAI, Azure, Gemini,
Ollama), json_object with `schema` (llama.cpp), `structured_outputs.json` / `guided_json`
(vLLM), and json_object with the schema stated in the system prompt (any other server). By
settings, a fraction of answers is invalid JSON, truncated JSON (finish_reason "length") or a
refusal, and `reject_json_schema` answers json_schema with HTTP 500 the way older llama.cpp
servers do.

`typed_mode` models a small model behind a server that constrains nothing it cannot see:
"ignores_schema" answers free text, or copies the schema back when the prompt states it;
"out_of_range" answers valid JSON whose bounded numbers are out of range (confidence 10, 100,
1.2), except for a field whose bound the prompt states (a line naming the field and its bound):
the model obeys what it can read.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from typing import Any

# What a client writes before the schema in the system prompt (engine/structured.py says the
# same; the simulator imports nothing of the engine but token counting).
_PROMPT_MARKER = "JSON Schema:"
_WORDS = ("alpha", "beta", "gamma", "delta", "market", "growth", "bank", "oil", "rate")
TYPED_MODES = ("obeys", "ignores_schema", "out_of_range")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
REJECTION_MESSAGE = (
    'response_format type must be one of "text" or "json_object", but got: json_schema'
)


def rejects(body: dict[str, Any]) -> bool:
    """True for the form `reject_json_schema` refuses: response_format json_schema."""
    fmt = body.get("response_format")
    return isinstance(fmt, dict) and fmt.get("type") == "json_schema"


def requested_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON Schema the request asks the answer to match, in whichever form it came."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        if fmt.get("type") == "json_schema":
            return (fmt.get("json_schema") or {}).get("schema") or {}
        if fmt.get("type") == "json_object":
            if isinstance(fmt.get("schema"), dict):
                return fmt["schema"]
            return _schema_in_prompt(body.get("messages") or []) or {}
    guided = (body.get("structured_outputs") or {}).get("json") or body.get("guided_json")
    if isinstance(guided, str):
        guided = json.loads(guided)
    return guided if isinstance(guided, dict) else None


def _schema_in_prompt(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    for m in messages:
        text = m.get("content")
        if m.get("role") == "system" and isinstance(text, str) and _PROMPT_MARKER in text:
            rest = text.split(_PROMPT_MARKER, 1)[1].lstrip()
            try:
                doc, _ = json.JSONDecoder().raw_decode(rest)
            except ValueError:
                return None
            return doc if isinstance(doc, dict) else None
    return None


Unseen = Callable[[str, dict[str, Any]], bool]


def generate(
    schema: dict[str, Any], rng: random.Random, unseen: Unseen | None = None, name: str = ""
) -> Any:
    """A value that matches `schema` (the subset typed outputs use); with `unseen`, a number
    whose bounds unseen(field name, its schema) says the model cannot see is out of range."""
    options = [o for o in schema.get("anyOf", ()) if o.get("type") != "null"]
    if options:  # a nullable field: answered with a value
        return generate(options[0], rng, unseen, name)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties")
        if not props:
            return {"note": rng.choice(_WORDS)}
        return {key: generate(sub, rng, unseen, key) for key, sub in props.items()}
    if kind == "array":
        item = schema.get("items") or {}
        return [generate(item, rng, unseen, name) for _ in range(rng.randint(1, 3))]
    if kind == "boolean":
        return rng.random() < 0.5
    if kind in ("integer", "number"):
        bounded = "minimum" in schema or "maximum" in schema
        if bounded and unseen is not None and unseen(name, schema):
            return _out_of_range(schema, kind, rng)
        lo = schema.get("minimum", 0 if kind == "integer" else 0.0)
        hi = schema.get("maximum", lo + 100)
        if kind == "integer":
            return rng.randint(int(lo), int(hi))
        return round(rng.uniform(lo, hi), 3)
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))


def _out_of_range(schema: dict[str, Any], kind: str, rng: random.Random) -> float:
    """Above the maximum (10, 100 or 1.2 for a maximum of 1), else below the minimum."""
    hi, lo = schema.get("maximum"), schema.get("minimum")
    step = rng.choice((9, 99, 0.2))
    if isinstance(hi, int | float):
        value = hi + step * max(1, abs(hi))
        return math.ceil(value) if kind == "integer" else round(value, 3)
    value = lo - step * max(1, abs(lo))
    return math.floor(value) if kind == "integer" else round(value, 3)


def _bounds_seen(messages: Any) -> Unseen:
    """unseen(name, schema): no line of the conversation names the field and one of its bounds."""
    text = "\n".join(str(m.get("content") or "") for m in messages if isinstance(m, dict))
    lines = [line for line in text.splitlines() if _NUMBER.search(line)]

    def unseen(name: str, schema: dict[str, Any]) -> bool:
        bounds = {_number_text(schema[k]) for k in ("minimum", "maximum") if k in schema}
        return not any(
            name in line and bounds & set(_NUMBER.findall(line)) for line in lines if name
        )

    return unseen


def _number_text(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _ignored(schema_in_prompt: dict[str, Any] | None, rng: random.Random) -> str:
    """What a model that ignores the form writes: the schema it was shown, else prose."""
    if schema_in_prompt is not None:
        return json.dumps(schema_in_prompt, indent=2)
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 12))).capitalize() + "."


def answer(
    schema: dict[str, Any],
    seed: int,
    *,
    invalid: float,
    truncated: float,
    refuse: float,
    mode: str = "obeys",
    messages: Any = (),
) -> tuple[str | None, str | None, bool]:
    """(content, refusal, truncated?) for a schema request: valid JSON unless a fault is drawn
    or the mode says otherwise."""
    rng = random.Random(seed)
    if mode == "ignores_schema":
        return _ignored(_schema_in_prompt(list(messages)), rng), None, False
    unseen = _bounds_seen(messages) if mode == "out_of_range" else None
    text = json.dumps(generate(schema, rng, unseen))
    x = rng.random()
    if x < refuse:
        return None, "I'm sorry, I can't help with that request.", False
    x -= refuse
    if x < invalid:
        return text.replace('"', "'", 2) + " (as requested)", None, False
    x -= invalid
    if x < truncated:
        return text[: max(1, len(text) // 2)], None, True
    return text, None, False
