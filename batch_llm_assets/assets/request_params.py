"""Request parameters that break one row -> one paid answer -> one stored row, refused at load."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..engine.errors import BatchLLMError


def check_params(params: Mapping[str, Any] | None, *, where: str = "params") -> None:
    """Raise, naming the parameter, for `n` other than 1 (every answer is paid, one is stored)
    and `stream: true` (a stream is not a chat.completion body: every answer would be
    malformed and retried)."""
    params = params or {}
    n = params.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise BatchLLMError(
            description=f"{where}.n is {n!r}: each row stores one answer, but the provider "
            "would bill n answers. Remove `n` or set it to 1."
        )
    if params.get("stream"):
        raise BatchLLMError(
            description=f"{where}.stream is {params['stream']!r}: streamed answers are not "
            "supported (each would be read as malformed and retried). Remove `stream`."
        )
