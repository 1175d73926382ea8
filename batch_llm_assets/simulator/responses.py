"""What the simulator's answers share: OpenAI's error body, rate-limit and retry headers."""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web

from .limits import Limit


def openai_duration(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-* format: 12ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    rest_s = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{rest_s}s" if minutes else f"{rest_s}s"


def error(
    status: int,
    message: str,
    type_: str,
    code: str | None,
    headers: dict[str, str] | None = None,
    param: Any = None,
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def limit_headers(
    limits: dict[str, Limit | None], *, limit_header: str, rate_headers: bool, now: float
) -> dict[str, str]:
    """x-ratelimit-* for each limited dimension ("requests", "tokens"), as configured:
    x-ratelimit-limit-* per minute (OpenAI), as the bucket's capacity, or not at all; the
    remaining and reset ones on or off (not every provider or gateway sends them). "ietf": a
    gateway's generic headers instead, for requests only (the IETF draft's RateLimit-Limit, the
    window's quota, -Remaining and -Reset in whole seconds, as Kong sends them)."""
    if limit_header == "ietf":
        return _ietf(limits.get("requests"), rate_headers=rate_headers, now=now)
    h: dict[str, str] = {}
    for name, limit in limits.items():
        if limit is None:
            continue
        if limit_header == "per_minute":
            h[f"x-ratelimit-limit-{name}"] = str(limit.per_min)
        elif limit_header == "capacity":
            h[f"x-ratelimit-limit-{name}"] = str(int(limit.capacity))
        if rate_headers:
            h[f"x-ratelimit-remaining-{name}"] = str(limit.remaining(now))
            h[f"x-ratelimit-reset-{name}"] = openai_duration(limit.reset_s(now))
    return h


def _ietf(limit: Limit | None, *, rate_headers: bool, now: float) -> dict[str, str]:
    if limit is None:
        return {}
    h = {"ratelimit-limit": str(int(limit.capacity))}
    if rate_headers:
        h["ratelimit-remaining"] = str(limit.remaining(now))
        h["ratelimit-reset"] = str(math.ceil(limit.reset_s(now)))
    return h


def retry_headers(style: str, wait: float) -> dict[str, str]:
    """retry-after-ms and/or retry-after (whole seconds, rounded up) for a wait of `wait` s."""
    h = {}
    if style in ("both", "ms"):
        h["retry-after-ms"] = str(max(1, round(wait * 1000)))
    if style in ("both", "seconds"):
        h["retry-after"] = str(max(1, math.ceil(wait)))
    return h
