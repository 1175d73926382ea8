"""Service tiers (a request's `service_tier`): flex processing and its capacity shortages.

OpenAI's flex processing (https://developers.openai.com/api/docs/guides/flex-processing) serves
a request at Batch API prices, more slowly, and "may sometimes lack sufficient resources to
handle your requests, resulting in a `429 Resource Unavailable` error code. You will not be
charged when this occurs." The answer names the tier that served it: "When the service_tier
parameter is set, the response body will include the service_tier value based on the
processing mode actually used to serve the request" ('default' for the standard tier, to which
'auto' resolves for a project without another default).

`flex_unavailable` is the fraction of flex requests refused so. Which ones is decided by the
prompt's digest and how many times that prompt was asked at flex before (not a random draw),
so a run's outcome is the same whatever the concurrency; 1.0 is a shortage that never ends.
A refused request is not counted against the rate limits.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .responses import error

if TYPE_CHECKING:
    from .server import Simulator

TIERS = ("auto", "default", "flex", "priority", "scale")
FLEX_UNAVAILABLE_CODE = "resource_unavailable"


def refusal(sim: Simulator, body: dict[str, Any], model: str, digest: str) -> web.Response | None:
    """A 400 for a tier no provider has, a 429 Resource Unavailable for a flex request that
    meets a shortage, else None."""
    tier = body.get("service_tier")
    if tier is None:
        return None
    if tier not in TIERS:
        sim.counts["rejected_400"] += 1
        return error(
            400,
            f"Invalid value for 'service_tier': {str(tier)[:40]!r}; expected one of {TIERS}.",
            "invalid_request_error",
            "invalid_value",
            param="service_tier",
        )
    share = sim.config.flex_unavailable
    if tier != "flex" or share <= 0:
        return None
    asked = sim.stats.flex_asks[digest]
    sim.stats.flex_asks[digest] += 1
    seed = f"{sim.config.seed}|{digest}|{asked}".encode()
    if int(hashlib.sha256(seed).hexdigest()[:12], 16) / 16**12 >= share:
        return None
    sim.counts["flex_unavailable"] += 1
    return error(
        429,
        f"Resource Unavailable: flex processing is short of capacity for {model} right now. "
        "Retry later, or send the request with service_tier 'auto' for standard processing.",
        FLEX_UNAVAILABLE_CODE,
        FLEX_UNAVAILABLE_CODE,
    )


def served(body: dict[str, Any]) -> dict[str, str]:
    """The answer's `service_tier` field: the tier that served it, when the request set one."""
    tier = body.get("service_tier")
    if tier is None:
        return {}
    return {"service_tier": "default" if tier == "auto" else tier}
