"""The simulator's answer text: deterministic from the prompt, cut to the answer budget.

A model at temperature 0 answers the same prompt the same way: content is drawn from the
prompt's digest, an 'Answer with one of: a, b, c' prompt gets one of its labels, and a schema
request gets JSON generated from its schema (simulator/structured.py).
"""

from __future__ import annotations

import random
from typing import Any

from ..engine.tokens import count_text_tokens, encoding_for
from . import structured
from .counting import messages_digest

_WORDS = [
    "the",
    "market",
    "price",
    "rose",
    "after",
    "strong",
    "earnings",
    "while",
    "analysts",
    "expect",
    "growth",
    "in",
    "demand",
    "and",
    "the",
    "company",
    "said",
    "revenue",
    "fell",
    "as",
    "costs",
    "increased",
    "but",
    "investors",
    "remain",
    "calm",
    "about",
    "risk",
    "shares",
    "bank",
    "rate",
    "policy",
    "trade",
    "oil",
    "data",
    "report",
    "quarter",
    "profit",
    "loss",
    "outlook",
]
LABEL_MARKER = "Answer with one of:"


def fit(content: str, model: str, max_tokens: int) -> tuple[str, int, str]:
    """(content cut to max_tokens, its tokens, finish_reason)."""
    enc = encoding_for(model)
    if enc is None:
        return content, count_text_tokens(content, model), "stop"
    ids = enc.encode(content, disallowed_special=())
    if len(ids) > max_tokens:
        return enc.decode(ids[:max_tokens]), max_tokens, "length"
    return content, len(ids), "stop"


def answer(
    messages: list[dict[str, Any]], model: str, max_tokens: int, *, max_answer_tokens: int
) -> tuple[str, int, str]:
    """(content, completion tokens, finish_reason) of a plain chat request."""
    seed = int(messages_digest(messages)[:12], 16)
    text = "\n".join(str(m.get("content") or "") for m in messages)
    if LABEL_MARKER in text:
        options = text.split(LABEL_MARKER, 1)[1].splitlines()[0].strip().rstrip(".")
        labels = [o.strip() for o in options.split(",") if o.strip()]
        if labels:
            return fit(labels[seed % len(labels)], model, max_tokens)
    rng = random.Random(seed)
    n = rng.randint(3, max(3, max_answer_tokens))
    content = " ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + "."
    return fit(content, model, max_tokens)


def structured_answer(
    schema: dict[str, Any], messages: Any, model: str, max_tokens: int, *, config: Any
) -> tuple[str | None, str | None, int, str]:
    """(content, refusal, completion tokens, finish_reason) of a schema request."""
    seed = int(messages_digest(messages)[:12], 16)
    content, refusal, cut = structured.answer(
        schema,
        seed,
        invalid=config.invalid_json,
        truncated=config.truncated_json,
        refuse=config.refuse,
        mode=config.typed_mode,
        messages=messages,
    )
    if content is None:
        return None, refusal, count_text_tokens(refusal or "", model), "stop"
    content, n, finish = fit(content, model, max_tokens)
    return content, None, n, "length" if cut else finish
