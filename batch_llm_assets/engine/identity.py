"""The identity of a request: what a rerun compares to decide that a row's answer still holds.

It is the sha256 of the exact body sent (after every default: model, max_tokens, params,
messages) and of what else decides the answer: the provider kind (OpenAI, Azure OpenAI, Gemini,
or a self-hosted server) and Azure's api_version (its deployment is the body's `model`). Never
the key, and not the transport: the host, port, scheme and path of the endpoint are left out,
so a self-hosted server that moves (a new pod address, a restarted llama.cpp on another port, a
gateway in front of the same model) does not make a rerun pay again. `pin_endpoint` puts the
endpoint back in, for two endpoints that serve different models under one name.
Numbers are normalised (`1` and `1.0` are the same temperature) and keys sorted, so only a
change that reaches the provider changes the identity.

`service_tier: "flex"` is left out (`_tier_neutral`): flex processing is the same model's
answer at another price (https://developers.openai.com/api/docs/guides/flex-processing), so a
row answered at either tier is done for both (switching an asset to flex sends nothing again,
and a flex row answered at the standard tier by flex_fallback keeps its identity). Other tiers
stay in, as identities stored before flex was supported include them.

`legacy_scope` is the identity of the earlier definition (the body and the endpoint URL): rows
stored under it are still recognised as done, so an upgrade sends nothing again.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import orjson

from .profiles import detect_provider

SELF_HOSTED = "self-hosted"
_HOSTED = {"openai": "openai", "azure": "azure", "azureopenai": "azure", "gemini": "gemini"}


def endpoint_scope(
    base_url: str,
    api_version: str | None = None,
    *,
    provider: str | None = None,
    pin_endpoint: bool = False,
) -> dict[str, Any]:
    """What of the endpoint decides an answer: the provider kind, Azure's api_version, and the
    endpoint itself only when pinned."""
    name = (provider or detect_provider(base_url, api_version=api_version)).lower()
    scope: dict[str, Any] = {
        "provider": _HOSTED.get(name.replace(" ", "").replace("_", ""), SELF_HOSTED),
        "api_version": api_version,
    }
    if pin_endpoint:
        scope["endpoint"] = base_url.rstrip("/")
    return scope


def legacy_scope(base_url: str, api_version: str | None = None) -> dict[str, Any]:
    """The scope of the identity before the provider kind replaced the endpoint URL."""
    return {"endpoint": base_url.rstrip("/"), "api_version": api_version}


def identity_scopes(
    base_url: str,
    api_version: str | None = None,
    *,
    provider: str | None = None,
    pin_endpoint: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the scope new identities are made in, the legacy one stored rows may carry)."""
    scope = endpoint_scope(base_url, api_version, provider=provider, pin_endpoint=pin_endpoint)
    return scope, legacy_scope(base_url, api_version)


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


def _tier_neutral(body: dict[str, Any]) -> dict[str, Any]:
    if body.get("service_tier") != "flex":
        return body
    return {k: v for k, v in body.items() if k != "service_tier"}


def request_identity(body: dict[str, Any], scope: dict[str, Any]) -> str:
    """sha256 (hex) of the request body and its `endpoint_scope` (or `legacy_scope`)."""
    doc = {**scope, "body": _normalise(_tier_neutral(body))}
    return hashlib.sha256(_DUMPS(doc).encode("utf-8", "surrogatepass")).hexdigest()


class MessagesIdentity:
    """`request_identity` for bodies that differ only in their messages, at a third of the cost
    (a partition run hashes every row): the rest of the document is encoded once, and sorted-key
    JSON of the whole is the JSON of its parts, so the digest is the same."""

    def __init__(self, body: dict[str, Any], scope: dict[str, Any]):
        doc = {**scope, "body": _normalise({**_tier_neutral(body), "messages": _HOLE})}
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
