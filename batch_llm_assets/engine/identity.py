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

import orjson


def _normalise(value: Any) -> Any:
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if kind is dict and all(type(v) is str for v in value.values()):
        return (
            value if all(type(k) is str for k in value) else {str(k): v for k, v in value.items()}
        )
    if isinstance(value, bool | str):
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


_DUMPS = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
).encode
_HOLE = "\ue000messages\ue000"  # a private-use placeholder no body contains


def request_identity(body: dict[str, Any], base_url: str, api_version: str | None = None) -> str:
    """sha256 (hex) of the request body and the endpoint it goes to; the key is not part of it."""
    doc = {
        "body": _normalise(body),
        "endpoint": base_url.rstrip("/"),
        "api_version": api_version,
    }
    return hashlib.sha256(_DUMPS(doc).encode("utf-8", "surrogatepass")).hexdigest()


class MessagesIdentity:
    """`request_identity` for bodies that differ only in their messages, at a third of the cost
    (a partition run hashes every row): the rest of the document is encoded once, and sorted-key
    JSON of the whole is the JSON of its parts, so the digest is the same."""

    def __init__(self, body: dict[str, Any], base_url: str, api_version: str | None = None):
        doc = {
            "body": _normalise({**body, "messages": _HOLE}),
            "endpoint": base_url.rstrip("/"),
            "api_version": api_version,
        }
        text = _DUMPS(doc)
        hole = _DUMPS(_HOLE)
        if text.count(hole) != 1:
            raise ValueError("the placeholder occurs in the request body")
        head, tail = text.split(hole)
        self._head, self._tail = head.encode(), tail.encode()

    def __call__(self, messages: list[dict[str, Any]], *, text_only: bool = False) -> str:
        """`text_only`: every key and value of the messages is a str (rendered prompts), so
        there is nothing to normalise."""
        h = hashlib.sha256(self._head)
        if text_only:
            try:  # the same bytes as _DUMPS for str-only documents, at a fifth of the cost
                h.update(orjson.dumps(messages, option=orjson.OPT_SORT_KEYS))
            except orjson.JSONEncodeError:  # a lone surrogate: the standard encoder's bytes
                h.update(_DUMPS(messages).encode("utf-8", "surrogatepass"))
        else:
            h.update(_DUMPS(_normalise(messages)).encode("utf-8", "surrogatepass"))
        h.update(self._tail)
        return h.hexdigest()
