"""Flex processing: OpenAI's `service_tier: "flex"`, Batch API prices on the live API.

What OpenAI documents (https://developers.openai.com/api/docs/guides/flex-processing), and
what the engine does about it:
- "Flex processing may sometimes lack sufficient resources to handle your requests, resulting
  in a `429 Resource Unavailable` error code. You will not be charged when this occurs." Such a
  429 (errors.FLEX_UNAVAILABLE) says nothing about the key's rate: it never slows the shared
  limiter (errors.NOT_RATE_SIGNALS), and its retries do not spend the run's retry budget.
- "Retry requests with exponential backoff": up to max_attempts attempts in all, waiting
  FLEX_RETRY_DELAY_S doubling to FLEX_MAX_RETRY_DELAY_S (a server's retry hint wins).
- "Retry requests with standard processing ... set `service_tier` to `auto` in the retried
  request": with flex_fallback "standard", a row still short of capacity after its attempts is
  sent once more at `auto`, as a request of its own (its own attempts, the row's deadline).
  Without it the row fails resource_unavailable; a rerun sends it again.
- The answer's `service_tier` names the tier that served it ("flex", "default"): the result
  carries it, and the row is priced by it (assets/pricing.py).
- "increase default timeout to 15 minutes": FLEX_REQUEST_TIMEOUT_S when request_timeout_s is
  unset (resources/llm.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from . import _constants as C
from . import errors as E
from .requests import Attempts, ChatRequest, ChatResult, EngineSettings, backoff_delay

log = logging.getLogger(__name__)

FLEX = "flex"
FALLBACKS = (None, "standard")
STANDARD = "auto"  # the tier a fallback asks for: the project's default processing


def asks_flex(params: dict[str, Any]) -> bool:
    return params.get("service_tier") == FLEX


def check_tier(params: dict[str, Any]) -> None:
    """A `service_tier` in params is a tier's name; anything else is refused before sending."""
    tier = params.get("service_tier")
    if tier is not None and not (isinstance(tier, str) and tier.strip()):
        raise ValueError(
            f"params service_tier must be a tier's name such as 'flex' or 'auto', got "
            f"{type(tier).__name__} {str(tier)[:40]!r}"
        )


class FlexTier:
    """What a flex request short of capacity gets: a later attempt, or the standard tier."""

    def __init__(
        self,
        settings: EngineSettings,
        send: Callable[[ChatRequest], Awaitable[ChatResult]],
        request_body: Callable[..., dict[str, Any]],
    ) -> None:
        check_tier(settings.params)
        if settings.flex_fallback not in FALLBACKS:
            raise ValueError(
                f"flex_fallback must be 'standard' or None, got {settings.flex_fallback!r}"
            )
        self.fallback = settings.flex_fallback
        self.max_attempts = settings.max_attempts
        self._send = send
        self._request_body = request_body
        self.fallbacks = 0  # rows sent at the standard tier after their flex attempts

    async def shortage(
        self, req: ChatRequest, exc: E.ProviderError, st: Attempts
    ) -> float | ChatResult:
        """After a 429 Resource Unavailable: the delay before the next flex attempt, or the
        row's result (at the standard tier, or failed) once its attempts are spent."""
        if st.attempt < self.max_attempts:
            return backoff_delay(
                st.attempt,
                exc.retry_after_s,
                exact=exc.hint_exact,
                first_s=C.FLEX_RETRY_DELAY_S,
                max_s=C.FLEX_MAX_RETRY_DELAY_S,
            )
        if self.fallback is None:
            return st.failed(
                req,
                E.FLEX_UNAVAILABLE,
                f"{exc.message} (flex processing had no capacity on any of {st.attempt} "
                "attempts; set flex_fallback: standard to send such rows at the standard tier)",
            )
        return await self._at_standard_tier(req, st)

    async def _at_standard_tier(self, req: ChatRequest, st: Attempts) -> ChatResult:
        body = req.body if req.body is not None else self._request_body(req.messages, req.params)
        body = {**body, "service_tier": STANDARD}
        self.fallbacks += 1
        if self.fallbacks == 1:
            log.warning(
                "Flex processing had no capacity for a request after %d attempts: it is sent at "
                "the standard tier (flex_fallback: standard) and priced at the standard rate; "
                "the rows say which tier answered (service_tier).",
                st.attempt,
            )
        result = await self._send(dataclasses.replace(req, body=body, deadline=st.deadline))
        result.attempts += st.attempt
        result.rate_limit_wait_s += st.waited
        result.http_429 += st.n429
        return result
