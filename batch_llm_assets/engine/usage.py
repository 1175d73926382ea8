"""Token usage in the shapes providers send it, and the provider's rate-limit headers.

OpenAI sends usage as prompt/completion tokens with details (cached input, reasoning); some
OpenAI-compatible servers send input/output tokens (the Responses/Anthropic shape) or nothing.
Rate-limit headers: x-ratelimit-{limit,remaining,reset}-{requests,tokens}, resets in OpenAI's
duration format (6m0s, 1.5s, 12ms) or plain seconds. A gateway's generic ones (Kong, Envoy's
rate-limit filter, Dev Proxy: the IETF draft's RateLimit-Remaining/-Reset, its later
`RateLimit: "p";r=..;t=..`, and X-RateLimit-Remaining/-Reset) are read as the requests' when
OpenAI's are absent; not their limit: it is a quota per the gateway's window, not per minute.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from . import _constants as C


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return int(value)
    return None


def parse_usage(usage: Any) -> Usage | None:
    """Usage from a response body's `usage` (any known shape), or None when absent/unreadable."""
    if not isinstance(usage, dict):
        return None
    prompt = _int(usage.get("prompt_tokens"))
    completion = _int(usage.get("completion_tokens"))
    if prompt is None:
        prompt = _int(usage.get("input_tokens"))
        completion = _int(usage.get("output_tokens"))
    if prompt is None:
        return None
    if completion is None:
        total = _int(usage.get("total_tokens"))
        completion = max(0, total - prompt) if total is not None else 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    out_details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    if cached is None:
        cached = _int(usage.get("cache_read_input_tokens"))
    reasoning = _int(out_details.get("reasoning_tokens")) if isinstance(out_details, dict) else None
    return Usage(prompt, completion, cached or 0, reasoning or 0)


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_duration(value: str | None) -> float | None:
    """Seconds from OpenAI's `6m0s` / `1.5s` / `12ms`, or from plain seconds (`0.5`, `2`)."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        parts = _DURATION_PART.findall(value)
        if not parts or "".join(n + u for n, u in parts) != value:
            return None
        seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
    # NaN or infinity (also a duration of 400 digits) says nothing: a window "reset" at
    # infinity would hold every grant
    return max(0.0, seconds) if math.isfinite(seconds) else None


@dataclass(frozen=True, slots=True)
class ProviderLimits:
    """What one response says about the provider's buckets; None where a header is missing."""

    limit_requests: int | None = None
    limit_tokens: int | None = None
    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    reset_requests_s: float | None = None
    reset_tokens_s: float | None = None

    @property
    def empty(self) -> bool:
        return all(getattr(self, f) is None for f in self.__slots__)


def _header_int(headers: dict[str, str], name: str) -> int | None:
    return _count(headers.get(name))


def _count(text: str | None) -> int | None:
    """A count of the provider's; None if missing, not a number, infinite or negative."""
    try:
        value = int(float(text))  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return value if value >= 0 else None


def parse_limits(headers: dict[str, str]) -> ProviderLimits:
    """x-ratelimit-* of a response (header names lower-cased), else a gateway's generic ones."""
    h = headers
    remaining = _header_int(h, "x-ratelimit-remaining-requests")
    reset = parse_duration(h.get("x-ratelimit-reset-requests"))
    if remaining is None and reset is None:
        remaining, reset = _generic(h)
    return ProviderLimits(
        limit_requests=_header_int(h, "x-ratelimit-limit-requests"),
        limit_tokens=_header_int(h, "x-ratelimit-limit-tokens"),
        remaining_requests=remaining,
        remaining_tokens=_header_int(h, "x-ratelimit-remaining-tokens"),
        reset_requests_s=reset,
        reset_tokens_s=parse_duration(h.get("x-ratelimit-reset-tokens")),
    )


_FIELD = re.compile(r";\s*([rt])\s*=\s*([0-9]+)")


def _generic(h: dict[str, str]) -> tuple[int | None, float | None]:
    """(remaining, reset s) of a gateway's generic headers, the first of them that it sends.
    The reset is read as delta-seconds (the drafts'), up to MAX_GENERIC_RESET_S; an HTTP date
    does not parse. Otherwise the remaining count stands without a reset."""
    # The structured field may list several policies: the one with the least left binds.
    items = [dict(_FIELD.findall(item)) for item in h.get("ratelimit", "").split(",")]
    fields = min((i for i in items if "r" in i), key=lambda i: float(i["r"]), default={})
    for remaining, reset in (
        (fields.get("r"), fields.get("t")),
        (h.get("ratelimit-remaining"), h.get("ratelimit-reset")),
        (h.get("x-ratelimit-remaining"), h.get("x-ratelimit-reset")),
    ):
        if remaining is not None:
            seconds = parse_duration(reset)
            delta = seconds if seconds is not None and seconds <= C.MAX_GENERIC_RESET_S else None
            return _count(remaining), delta
    return None, None
