"""The identity of a request: what a rerun compares to decide that a row's answer still holds.

It is the sha256 of the exact body sent (after every default: model, max_tokens, params,
messages) and of the endpoint (base_url, api_version), never of the key. Numbers are normalised
(`1` and `1.0` are the same temperature) and keys sorted, so only a change that reaches the
provider changes the identity.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any


def _normalise(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        return value
    if isinstance(value, dict):
        return {str(k): _normalise(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_normalise(v) for v in value]
    return value


def request_identity(body: dict[str, Any], base_url: str, api_version: str | None = None) -> str:
    """sha256 (hex) of the request body and the endpoint it goes to; the key is not part of it."""
    doc = {
        "body": _normalise(body),
        "endpoint": base_url.rstrip("/"),
        "api_version": api_version,
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
