"""What goes into the engine and what comes out: requests, results, settings, and the checks
made before anything is sent (no network)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import _constants as C
from .adaptive import check_concurrency
from .errors import ProviderError

if TYPE_CHECKING:
    from .outcome import Outcome
    from .transport import ChatResponse


@dataclass(slots=True)
class ChatRequest:
    """One chat completion to make. `params` override the resource's defaults."""

    id: Any
    messages: list[dict[str, Any]] | None
    params: dict[str, Any] | None = None
    deadline: float | None = None  # time.monotonic() after which it is not sent again
    error: tuple[str, str] | None = None  # (class, message): a bad row, failed without sending
    # Typed outputs (engine/structured.py): checks an ok answer -> None or (error class, message);
    # an invalid_output one is re-asked with the error up to repair_attempts times.
    validate: Callable[[ChatResult], tuple[str, str] | None] | None = None
    repair_attempts: int = 0
    # The exact body to send, when the caller built it already (to hash it): the engine sends
    # it as it is (its token-limit parameter aside), instead of building it again.
    body: dict[str, Any] | None = None


@dataclass(slots=True)
class ChatResult:
    """What became of one request. `status` is "ok" or "failed" (then `error_class` says why).

    `tokens_estimated`: the provider sent no usage, so the token counts are the engine's
    estimate (prompt) and a count of the answer's text (completion)."""

    id: Any
    status: str
    response: str | None = None
    finish_reason: str | None = None
    refusal: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_ms: float | None = None  # the successful (or last) attempt alone
    total_ms: float | None = None  # first send to final result: retries and waits included
    attempts: int = 0
    error_class: str | None = None
    error_message: str | None = None
    estimated_tokens: int | None = None
    rate_limit_wait_s: float = 0.0
    http_429: int = 0
    model: str | None = None  # the model named in the answer (may differ from the one asked)
    tokens_estimated: bool = False  # no usage in the answer: the tokens are the estimate
    cached_tokens: int | None = None  # prompt tokens the provider billed at its cached rate
    reasoning_tokens: int | None = None
    service_tier: str | None = None  # the tier the answer says served it (flex, default, ...)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(slots=True)
class Attempts:
    """What one request's attempts have accumulated (the engine's, per request)."""

    estimate: int
    deadline: float | None = None  # time.monotonic() after which it is not sent again
    attempt: int = 0
    waited: float = 0.0
    n429: int = 0
    first_send: float | None = None
    last: ProviderError | None = None

    def failed(self, req: ChatRequest, error_class: str, message: str) -> ChatResult:
        total = (time.perf_counter() - self.first_send) * 1000 if self.first_send else None
        return failed(
            req,
            error_class,
            message,
            attempts=self.attempt,
            total_ms=total,
            estimated_tokens=self.estimate,
            rate_limit_wait_s=self.waited,
            http_429=self.n429,
        )

    def answered(
        self,
        req: ChatRequest,
        resp: ChatResponse,
        verdict: Outcome,
        *,
        started: float,
        tokens: tuple[int | None, int | None, bool],
    ) -> ChatResult:
        """The row's result from an answer, sent at `started` (time.perf_counter()) and judged
        `verdict`; `tokens`: (prompt, completion, estimated) as usage (or the estimate) says."""
        ended = time.perf_counter()
        usage = resp.usage
        return ChatResult(
            req.id,
            verdict.status,
            response=verdict.response,
            finish_reason=resp.finish_reason,
            refusal=resp.refusal,
            error_class=verdict.error_class,
            error_message=verdict.message,
            prompt_tokens=tokens[0],
            completion_tokens=tokens[1],
            latency_ms=(ended - started) * 1000,
            total_ms=(ended - (self.first_send or started)) * 1000,
            attempts=self.attempt,
            estimated_tokens=self.estimate,
            rate_limit_wait_s=self.waited,
            http_429=self.n429,
            model=resp.model,
            tokens_estimated=tokens[2],
            cached_tokens=usage.cached_tokens if usage else None,
            reasoning_tokens=usage.reasoning_tokens if usage else None,
            service_tier=resp.service_tier,
        )


@dataclass(slots=True)
class EngineSettings:
    model: str
    params: dict[str, Any] = field(default_factory=dict)
    max_concurrency: int = C.DEFAULT_MAX_CONCURRENCY
    request_timeout_s: float = C.DEFAULT_REQUEST_TIMEOUT_S
    max_attempts: int = C.DEFAULT_MAX_ATTEMPTS
    deadline_s: float | None = None
    default_max_tokens: int = C.DEFAULT_MAX_TOKENS
    context_window: int | None = None
    refund_unused_completion: bool = False
    fatal_error_threshold: int = C.FATAL_ERROR_THRESHOLD
    secret: str = ""
    # None: max_completion_tokens for OpenAI reasoning models, else max_tokens.
    token_param: str | None = None
    # Scale-up of prompt estimates; None: FALLBACK_ESTIMATE_MARGIN for a model whose tokenizer
    # tiktoken does not know (its count is a guess), 0 otherwise.
    estimate_margin: float | None = None
    breaker_threshold: int = C.BREAKER_THRESHOLD
    retry_budget_base: int = C.RETRY_BUDGET_BASE
    retry_budget_ratio: float = C.RETRY_BUDGET_RATIO
    # "standard": a flex request still short of capacity after max_attempts is sent at the
    # standard tier (engine/flex.py); None: it fails resource_unavailable.
    flex_fallback: str | None = None

    def __post_init__(self) -> None:
        check_concurrency(self.max_concurrency)  # 0, negative, NaN: a clear error, not 1 worker


def backoff_delay(
    attempt: int,
    hint_s: float | None,
    *,
    exact: bool = True,
    first_s: float = C.INITIAL_RETRY_DELAY_S,
    max_s: float = C.MAX_RETRY_DELAY_S,
) -> float:
    """The server's hint when it gives a sane one, else exponential backoff from `first_s`,
    capped at `max_s`, with jitter.

    A whole-second hint (not `exact`) is the real wait rounded up: only an upper bound."""
    delay = min(first_s * 2 ** (attempt - 1), max_s)
    delay *= 1 - C.RETRY_JITTER * random.random()
    if hint_s is not None and 0 <= hint_s <= C.MAX_SERVER_HINT_S:
        return hint_s if exact else min(hint_s, delay)
    return delay


def _blank(content: Any) -> bool:
    if isinstance(content, str):
        return not content.strip()
    return not content


def has_user_prompt(messages: list[dict[str, Any]]) -> bool:
    """At least one user message, and none of them blank."""
    found = False
    for m in messages:
        if m.get("role") == "user":
            if _blank(m.get("content")):
                return False
            found = True
    return found


NON_FINITE = "hold a NaN or infinite number, which JSON cannot carry"


def non_finite(value: Any) -> bool:
    """A NaN or infinity anywhere in request params (a temperature from a bad row, say)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(non_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(non_finite(v) for v in value)
    return False


def failed(req: ChatRequest, error_class: str, message: str, **kw: Any) -> ChatResult:
    return ChatResult(req.id, "failed", error_class=error_class, error_message=message, **kw)
