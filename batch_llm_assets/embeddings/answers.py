"""Reading an embeddings answer: its vectors (float lists or base64 of little-endian float32, as
the openai SDK reads them: lib/_parsing/_embeddings.py), by `index`, each checked; anything else
is malformed. And the result of a row: ChatResult's fields (the run's stats read them) and its
vector. OpenAI reports usage per request, not per input: a row's prompt_tokens is the usage
shared in proportion to the rows' own token counts (`shares`, summing exactly to the usage).
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..engine import errors as E
from ..engine.engine import ChatResult
from ..engine.usage import Usage, parse_usage


@dataclass(slots=True)
class EmbeddingResult(ChatResult):
    """A row's result: ChatResult's fields (the run's stats read them) and the row's vector."""

    embedding: Any = None  # float32 vector of an ok row
    truncated: bool = False


@dataclass(slots=True)
class EmbeddingAnswer:
    """A readable answer: one vector per input, in input order; `usage` and `headers` are what
    the pacer and the gate read of any answer."""

    vectors: list[np.ndarray]
    usage: Usage | None
    headers: dict[str, str]
    model: str | None


def _vector(value: Any, dims: int | None) -> np.ndarray:
    if isinstance(value, str):  # base64 of little-endian float32 (the openai SDK's reading)
        vec = np.frombuffer(base64.b64decode(value, validate=True), dtype="<f4")
    else:
        vec = np.asarray(value, dtype=np.float32)
    if vec.ndim != 1 or not vec.size or (dims is not None and vec.size != dims):
        raise ValueError(f"a vector of shape {vec.shape}, expected ({dims or 'n'},)")
    if not np.isfinite(vec).all():
        raise ValueError("a vector holds NaN or infinite numbers")
    return vec


def decode(payload: Any, headers: dict[str, str], n: int, dims: int | None) -> EmbeddingAnswer:
    """The vectors of an answer to `n` inputs, by their `index`; anything else is malformed."""
    try:
        data = payload["data"]
        if not isinstance(data, list) or len(data) != n:
            raise ValueError(
                f"{len(data) if isinstance(data, list) else 'no'} vectors for {n} inputs"
            )
        vectors: list[Any] = [None] * n
        for entry in data:
            i = entry["index"]
            if type(i) is not int or not 0 <= i < n or vectors[i] is not None:
                raise ValueError(f"index {i!r}")
            vectors[i] = _vector(entry["embedding"], dims)
        model = payload.get("model")
        usage = parse_usage(payload.get("usage"))
    except (KeyError, TypeError, ValueError, AttributeError, binascii.Error) as exc:
        raise E.ProviderError(
            E.MALFORMED_RESPONSE,
            f"unexpected embeddings body: {exc}"[:300],
            status=200,
            retryable=True,
        ) from None
    return EmbeddingAnswer(vectors, usage, headers, model if isinstance(model, str) else None)


def shares(total: int, counts: list[int]) -> list[int]:
    """`total` split in proportion to `counts` (largest remainders), summing exactly to it."""
    weights = counts if sum(counts) > 0 else [1] * len(counts)
    whole = sum(weights)
    raw = [total * w / whole for w in weights]
    out = [math.floor(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: out[i] - raw[i])
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out
