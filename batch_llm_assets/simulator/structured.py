"""The simulator's structured outputs: answer a schema request with JSON generated from it.

Every form a client may send is read: `response_format` json_schema (OpenAI, Azure, Gemini,
Ollama), json_object with `schema` (llama.cpp), `structured_outputs.json` / `guided_json`
(vLLM), and json_object with the schema stated in the system prompt (any other server). By
settings, a fraction of answers is invalid JSON, truncated JSON (finish_reason "length") or a
refusal, and `reject_json_schema` answers json_schema with HTTP 500 the way older llama.cpp
servers do.
"""

from __future__ import annotations

import json
import random
from typing import Any

# What a client writes before the schema in the system prompt (engine/structured.py says the
# same; the simulator imports nothing of the engine but token counting).
_PROMPT_MARKER = "JSON Schema:"
_WORDS = ("alpha", "beta", "gamma", "delta", "market", "growth", "bank", "oil", "rate")
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


def generate(schema: dict[str, Any], rng: random.Random) -> Any:
    """A value that matches `schema` (the subset typed outputs use)."""
    options = [o for o in schema.get("anyOf", ()) if o.get("type") != "null"]
    if options:  # a nullable field: answered with a value
        return generate(options[0], rng)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties")
        if not props:
            return {"note": rng.choice(_WORDS)}
        return {name: generate(sub, rng) for name, sub in props.items()}
    if kind == "array":
        return [generate(schema.get("items") or {}, rng) for _ in range(rng.randint(1, 3))]
    if kind == "boolean":
        return rng.random() < 0.5
    if kind in ("integer", "number"):
        lo = schema.get("minimum", 0 if kind == "integer" else 0.0)
        hi = schema.get("maximum", lo + 100)
        if kind == "integer":
            return rng.randint(int(lo), int(hi))
        return round(rng.uniform(lo, hi), 3)
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))


def answer(
    schema: dict[str, Any], seed: int, *, invalid: float, truncated: float, refuse: float
) -> tuple[str | None, str | None, bool]:
    """(content, refusal, truncated?) for a schema request: valid JSON unless a fault is drawn."""
    rng = random.Random(seed)
    text = json.dumps(generate(schema, rng))
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
