"""The async engine: many chat requests in, one result record per request out.

Per request: validate and estimate (no network for bad input), wait for a slot of the shared
limit (pacing.py), check the deadline, send, classify the answer and report it to the limiter,
and retry what can be retried within the run's retry budget. The breaker stops a run that can
only fail.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any

from . import _constants as C
from . import errors as E
from . import structured as S
from .breaker import Breaker
from .budget import Refused, SpendCap
from .flex import FlexTier
from .gate import ConcurrencyGate, held
from .limiter import Grant, RedisLimiter
from .outcome import TRUNCATED, classify_answer, tools_requested
from .pacing import Pacer
from .profiles import TokenParam
from .requests import (
    NON_FINITE,
    Attempts,
    ChatRequest,
    ChatResult,
    EngineSettings,
    backoff_delay,
    failed,
    has_user_prompt,
    non_finite,
)
from .runner import run_concurrently
from .tokens import (
    count_prompt_tokens,
    count_text_tokens,
    encoding_for,
    requested_max_tokens,
    uses_fallback_encoding,
)
from .transport import ChatResponse, ChatTransport

__all__ = ["ChatRequest", "ChatResult", "Engine", "EngineSettings", "backoff_delay"]

log = logging.getLogger(__name__)

_FREE = Grant(0.0)  # no limiter: every request goes at once


class Engine:
    """Runs requests concurrently through one transport and (optionally) one limiter."""

    def __init__(
        self,
        settings: EngineSettings,
        transport: ChatTransport,
        limiter: RedisLimiter | None = None,
        gate: ConcurrencyGate | None = None,
    ) -> None:
        if non_finite(settings.params):
            raise ValueError(f"The engine's params {NON_FINITE}.")
        self.s = settings
        self.transport = transport
        self.limiter = limiter
        self.gate = gate  # a self-hosted server's adaptive in-flight limit (gate.py), else fixed
        self.pacer = Pacer(limiter) if limiter is not None else None
        self.budget: SpendCap | None = None  # spend caps (budget.py), set by whoever prices
        self.breaker = Breaker(
            threshold=settings.breaker_threshold,
            fatal_threshold=settings.fatal_error_threshold,
            retry_budget_base=settings.retry_budget_base,
            retry_budget_ratio=settings.retry_budget_ratio,
        )
        self.flex = FlexTier(settings, self._send, self.request_body)  # service_tier flex
        self.token_param = TokenParam(settings.model, settings.token_param)
        self.warned_usage_estimated = False
        encoding_for(settings.model)  # load tiktoken's files now, not inside the first request
        fallback = uses_fallback_encoding(settings.model)
        self.estimate_margin = settings.estimate_margin
        if self.estimate_margin is None:
            self.estimate_margin = C.FALLBACK_ESTIMATE_MARGIN if fallback else 0.0
        if fallback:
            log.warning(
                "tiktoken does not know model %r: its token counts are estimated with a fallback "
                "encoding and reserved with a %.0f%% margin.",
                settings.model,
                self.estimate_margin * 100,
            )

    @property
    def limiter_wait_s(self) -> float:
        """Wall time during which at least one request waited for the limiter (not a sum over
        requests: 64 requests waiting the same second count one second)."""
        return self.pacer.wait_s if self.pacer is not None else 0.0

    @property
    def aborted_reason(self) -> str | None:
        """Why the batch stopped sending (breaker tripped), if it did."""
        return self.breaker.reason

    def map(
        self,
        requests: Iterable[ChatRequest] | AsyncIterable[ChatRequest],
        *,
        on_result: Callable[[ChatResult], None] | None = None,
    ) -> AsyncIterator[ChatResult]:
        """Yield one result per request, in completion order; at most max_concurrency in flight.

        Input is pulled lazily, so memory is bounded by the concurrency, not the batch.
        `on_result` runs in the worker the moment a result exists (the journal's hook), before
        it waits on the queue; if it raises, no further request is sent and the error is raised
        to the consumer. Cancel-safe: an exception in the consumer, `aclose()`, or cancellation
        cancels the workers at once (nothing awaits in their cleanup), so the run ends promptly.
        """
        return run_concurrently(
            self.run_one, requests, workers=self.s.max_concurrency, on_result=on_result
        )

    def request_body(
        self, messages: list[dict[str, Any]], params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The exact JSON body sent for these messages, every default applied (pure)."""
        body = {**self.s.params, **(params or {}), "model": self.s.model, "messages": messages}
        self.token_param.set(body, requested_max_tokens(body, self.s.default_max_tokens))
        return body

    def _prepare(self, req: ChatRequest) -> tuple[dict[str, Any], int, int] | ChatResult:
        """(body, estimate, max_tokens), or the failed result of a request not to send."""
        messages = req.messages
        if not messages or not has_user_prompt(messages):
            return failed(req, E.EMPTY_PROMPT, "prompt is null or empty; not sent")
        if req.params and non_finite(req.params):
            return failed(req, E.BAD_REQUEST, f"params {NON_FINITE}; not sent")
        body = req.body if req.body is not None else self.request_body(messages, req.params)
        max_tokens = requested_max_tokens(body, self.s.default_max_tokens)
        prompt = count_prompt_tokens(messages, self.s.model)
        estimate = math.ceil(prompt * (1 + self.estimate_margin)) + max_tokens
        window = self.s.context_window
        if window and estimate > window:
            return failed(
                req,
                E.CONTEXT_LENGTH,
                f"prompt + max_tokens is about {estimate} tokens, over the model's context "
                f"window of {window}; not sent",
                estimated_tokens=estimate,
            )
        ceiling = self.limiter.max_request_tokens if self.limiter is not None else None
        if ceiling and estimate > ceiling:
            return failed(
                req,
                E.REQUEST_TOO_LARGE,
                f"prompt + max_tokens is about {estimate} tokens, more than the tokens/min limit "
                f"of {ceiling} can ever admit; not sent",
                estimated_tokens=estimate,
            )
        return body, estimate, max_tokens

    async def run_one(self, req: ChatRequest) -> ChatResult:
        """One request through validation, limiter, retries. Never raises for provider errors."""
        result = await self._send(req)
        # Typed outputs: validate the answer, repair it (engine/structured.py). A truncated
        # answer is invalid JSON: it is repaired or fails invalid_output.
        if req.validate is not None and (result.ok or result.error_class == TRUNCATED):
            return await S.validated(self._send, req, result, self.breaker)
        return result

    async def _send(self, req: ChatRequest) -> ChatResult:
        """One chat completion (with its retries) and its raw result."""
        if req.error is not None:
            return failed(req, *req.error)
        prepared = self._prepare(req)
        if isinstance(prepared, ChatResult):
            return prepared
        body, estimate, max_tokens = prepared
        deadline = req.deadline
        if deadline is None and self.s.deadline_s is not None:
            deadline = time.monotonic() + self.s.deadline_s
        self.breaker.row_started()
        st = Attempts(estimate=estimate, deadline=deadline)
        signatures: set[str] = set()
        empty_retried = False
        while True:
            if self.breaker.reason:
                return self._stopped(req, st)
            sent = await self._attempt(req, body, max_tokens, deadline, st)
            if isinstance(sent, ChatResult):
                return sent
            resp, grant, started = sent
            if isinstance(resp, E.ProviderError):
                delay = await self._on_error(req, resp, grant, st, signatures)
                if isinstance(delay, ChatResult):
                    return delay
                if deadline is not None and time.monotonic() + delay >= deadline:
                    return self._deadline(req, st)
                await asyncio.sleep(delay)
                continue
            self.breaker.success()
            verdict = classify_answer(
                resp, tools_allowed=tools_requested(body), max_tokens=max_tokens
            )
            if verdict.retry and not empty_retried:  # billable: once, never max_attempts times
                empty_retried = True
                continue
            tokens = self._usage_or_estimate(st.estimate, max_tokens, resp)
            return st.answered(req, resp, verdict, started=started, tokens=tokens)

    async def _attempt(self, req, body, max_tokens, deadline, st: Attempts):
        """Wait for a slot and send once: (answer or ProviderError, grant, start time), or the
        row's final result when it cannot be sent; holding a place in the gate, if any."""
        async with held(self.gate):
            return await self._attempt_once(req, body, max_tokens, deadline, st)

    async def _attempt_once(self, req, body, max_tokens, deadline, st: Attempts):
        grant = _FREE
        if self.pacer is not None:
            before = time.monotonic()
            try:
                got = await self.pacer.slot(st.estimate, max_tokens, deadline)
            except E.LimiterError as exc:
                return st.failed(req, exc.error_class, str(exc.description))
            st.waited += time.monotonic() - before
            if got is None:
                return self._deadline(req, st)
            grant = got
        if self.breaker.reason or (deadline is not None and time.monotonic() >= deadline):
            if self.pacer is not None:
                await self.pacer.give_back(grant)
            if self.breaker.reason:
                return self._stopped(req, st)
            return self._deadline(req, st)
        t = self.s.request_timeout_s
        timeout = self.gate.timeout(t) if self.gate else t
        if deadline is not None:
            timeout = max(0.001, min(timeout, deadline - time.monotonic()))
        spend = await self.budget.hold(st.estimate, max_tokens, timeout) if self.budget else None
        if isinstance(spend, Refused):
            if self.pacer is not None:
                await self.pacer.give_back(grant)
            return st.failed(req, spend.error_class, spend.message)
        st.attempt += 1
        self.token_param.set(body, max_tokens)
        started = time.perf_counter()
        st.first_send = st.first_send or started
        mark = self.pacer.sent(st.estimate, max_tokens) if self.pacer is not None else None
        try:
            resp = await self.transport.chat(body, timeout)
        except E.ProviderError as exc:
            st.last = resp = exc
        if spend is not None:
            await self.budget.settle(spend, resp)
        if self.gate is not None:
            self.gate.observe(started, resp)
        if isinstance(resp, E.ProviderError):
            return resp, grant, started
        if self.pacer is not None and mark is not None:
            self.pacer.answered(
                grant,
                estimate=st.estimate,
                max_tokens=max_tokens,
                resp=resp,
                mark=mark,
                refund_unused=self.s.refund_unused_completion,
            )
        return resp, grant, started

    async def _on_error(
        self, req: ChatRequest, exc: E.ProviderError, grant: Grant, st: Attempts, sigs: set[str]
    ) -> float | ChatResult:
        """Count the error: the delay before the next attempt, or the row's failed result."""
        if req.validate is not None and S.rejects_structured(exc):
            # Typed outputs: a provider that refuses the JSON form refuses every row alike.
            self.breaker.fatal_error(exc)
            return st.failed(req, E.STRUCTURED_UNSUPPORTED, S.rejection_message(exc))
        if exc.error_class == E.FLEX_UNAVAILABLE:  # flex short of capacity: not a rate signal
            return await self.flex.shortage(req, exc, st)
        rate_limited = exc.status == 429 and exc.error_class not in E.NOT_RATE_SIGNALS
        if rate_limited:
            st.n429 += 1
            if self.pacer is not None:
                await self.pacer.rejected(grant, exc)
        if self.token_param.switch(exc.unsupported_param):
            return 0.0
        self.breaker.error(exc, sigs)
        if not exc.retryable or st.attempt >= self.s.max_attempts:
            return st.failed(req, exc.error_class, exc.message)
        if not rate_limited and not self.breaker.take_retry():
            return st.failed(
                req,
                E.RETRY_BUDGET,
                f"{exc.message} (not retried: the run's retry budget is spent)",
            )
        return backoff_delay(st.attempt, exc.retry_after_s, exact=exc.hint_exact)

    def _stopped(self, req: ChatRequest, st: Attempts) -> ChatResult:
        """The row's result when the breaker stopped the run. A row that already had a real
        error keeps it (class and message): "aborted" would hide why it failed. The others say
        why the run stopped."""
        why = f"the run stopped after {self.breaker.reason}"
        if st.last is not None:
            return st.failed(req, st.last.error_class, f"{st.last.message} (not retried: {why})")
        return st.failed(req, E.ABORTED, f"aborted: {why}")

    def _deadline(self, req: ChatRequest, st: Attempts) -> ChatResult:
        why = f" (last error: {st.last.message})" if st.last else ""
        return st.failed(
            req, E.DEADLINE_EXCEEDED, f"deadline passed before the request could be sent{why}"
        )

    def _usage_or_estimate(
        self, estimate: int, max_tokens: int, resp: ChatResponse
    ) -> tuple[int | None, int | None, bool]:
        """(prompt, completion, estimated): the provider's counts, else ours (warned once)."""
        if resp.usage is not None:
            return resp.usage.prompt_tokens, resp.usage.completion_tokens, False
        if not self.warned_usage_estimated:
            self.warned_usage_estimated = True
            log.warning(
                "The provider sent no token usage for model %r: token counts (and costs) are "
                "the engine's estimates, flagged tokens_estimated.",
                self.s.model,
            )
        content = resp.content if isinstance(resp.content, str) else ""
        return estimate - max_tokens, count_text_tokens(content, self.s.model), True

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) for the limiter feedback of answers already returned."""
        if self.pacer is not None:
            await self.pacer.drain(timeout_s)
