"""The async engine: many chat requests in, one result record per request out.

Per request: validate and estimate (no network for bad input), acquire from the shared limiter,
sleep once (a fresh slot if it woke late or a pause came in between), check the deadline, send,
reconcile the reservation with the usage and feed the provider's headers back, and retry what
can be retried within the run's retry budget. The breaker stops a run that can only fail.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import _constants as C
from . import errors as E
from .breaker import Breaker
from .limiter import Grant, RedisLimiter
from .profiles import token_param_for
from .tokens import (
    count_prompt_tokens,
    count_text_tokens,
    encoding_for,
    requested_max_tokens,
    uses_fallback_encoding,
)
from .transport import ChatResponse, ChatTransport
from .usage import parse_limits

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ChatRequest:
    """One chat completion to make. `params` override the resource's defaults."""

    id: Any
    messages: list[dict[str, Any]] | None
    params: dict[str, Any] | None = None
    deadline: float | None = None  # time.monotonic() after which it is not sent again
    error: tuple[str, str] | None = None  # (class, message): a bad row, failed without sending


@dataclass(slots=True)
class ChatResult:
    """What became of one request. `status` is "ok" or "failed" (then `error_class` says why).

    `tokens_estimated`: the provider sent no usage, so the token counts are the engine's
    estimate (prompt) and a count of the answer's text (completion)."""

    id: Any
    status: str
    response: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_ms: float | None = None
    attempts: int = 0
    error_class: str | None = None
    error_message: str | None = None
    estimated_tokens: int | None = None
    rate_limit_wait_s: float = 0.0
    http_429: int = 0
    tokens_estimated: bool = False
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


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


def backoff_delay(attempt: int, hint_s: float | None, *, exact: bool = True) -> float:
    """The server's hint when it gives a sane one, else capped exponential backoff with jitter.

    A whole-second hint (not `exact`) is the real wait rounded up: only an upper bound."""
    delay = min(C.INITIAL_RETRY_DELAY_S * 2 ** (attempt - 1), C.MAX_RETRY_DELAY_S)
    delay *= 1 - C.RETRY_JITTER * random.random()
    if hint_s is not None and 0 <= hint_s <= C.MAX_SERVER_HINT_S:
        return hint_s if exact else min(hint_s, delay)
    return delay


def _blank(content: Any) -> bool:
    if isinstance(content, str):
        return not content.strip()
    return not content


def _failed(req: ChatRequest, error_class: str, message: str, **kw: Any) -> ChatResult:
    return ChatResult(req.id, "failed", error_class=error_class, error_message=message, **kw)


class Engine:
    """Runs requests concurrently through one transport and (optionally) one limiter."""

    def __init__(
        self,
        settings: EngineSettings,
        transport: ChatTransport,
        limiter: RedisLimiter | None = None,
    ) -> None:
        self.s = settings
        self.transport = transport
        self.limiter = limiter
        self.breaker = Breaker(
            threshold=settings.breaker_threshold,
            fatal_threshold=settings.fatal_error_threshold,
            retry_budget_base=settings.retry_budget_base,
            retry_budget_ratio=settings.retry_budget_ratio,
        )
        self._paused_until = 0.0
        self._pause_epoch = 0  # bumped by every shared pause: slots granted before it are stale
        # Set when the provider's headers widen the burst: requests sleeping on slots granted
        # at the narrower one take fresh slots, which may be now.
        self._burst_grew = asyncio.Event()
        self._burst_s = limiter.settings.burst_s if limiter is not None else 0.0
        self.token_param = settings.token_param or token_param_for(settings.model)
        self.token_param_switched = False  # the provider rejected the first choice (recorded)
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
    def aborted_reason(self) -> str | None:
        """Why the batch stopped sending (breaker tripped), if it did."""
        return self.breaker.reason

    async def map(
        self, requests: Iterable[ChatRequest] | AsyncIterable[ChatRequest]
    ) -> AsyncIterator[ChatResult]:
        """Yield one result per request, in completion order; at most max_concurrency in flight.

        Input is pulled lazily, so memory is bounded by the concurrency, not the batch.
        """
        source = _aiter(requests)
        # Bounded: while the consumer is busy (writing a chunk), workers wait instead of piling up.
        out: asyncio.Queue[ChatResult | None] = asyncio.Queue(maxsize=self.s.max_concurrency)
        lock = asyncio.Lock()

        async def worker() -> None:
            try:
                while True:
                    async with lock:
                        try:
                            req = await anext(source)
                        except StopAsyncIteration:
                            return
                    await out.put(await self.run_one(req))
            finally:
                await out.put(None)

        n = max(1, self.s.max_concurrency)
        tasks = [asyncio.create_task(worker()) for _ in range(n)]
        try:
            finished = 0
            while finished < n:
                item = await out.get()
                if item is None:
                    finished += 1
                else:
                    yield item
            for t in tasks:
                t.result()  # surface a worker's unexpected exception
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _prepare(self, req: ChatRequest) -> tuple[dict[str, Any], int, int] | ChatResult:
        """(body, estimate, max_tokens), or the failed result of a request not to send."""
        messages = req.messages
        user = [m for m in messages or () if m.get("role") == "user"]
        if not user or any(_blank(m.get("content")) for m in user):
            return _failed(req, E.EMPTY_PROMPT, "prompt is null or empty; not sent")
        body = {**self.s.params, **(req.params or {}), "model": self.s.model, "messages": messages}
        max_tokens = requested_max_tokens(body, self.s.default_max_tokens)
        self._set_token_param(body, max_tokens)
        prompt = count_prompt_tokens(messages, self.s.model)
        estimate = math.ceil(prompt * (1 + self.estimate_margin)) + max_tokens
        window = self.s.context_window
        if window and estimate > window:
            return _failed(
                req,
                E.CONTEXT_LENGTH,
                f"prompt + max_tokens is about {estimate} tokens, over the model's context "
                f"window of {window}; not sent",
                estimated_tokens=estimate,
            )
        ceiling = self.limiter.max_request_tokens if self.limiter is not None else None
        if ceiling and estimate > ceiling:
            return _failed(
                req,
                E.REQUEST_TOO_LARGE,
                f"prompt + max_tokens is about {estimate} tokens, more than the tokens/min limit "
                f"of {ceiling} can ever admit; not sent",
                estimated_tokens=estimate,
            )
        return body, estimate, max_tokens

    def _set_token_param(self, body: dict[str, Any], max_tokens: int) -> None:
        """The answer budget under the parameter this model takes (one of the two, never both)."""
        other = (
            "max_tokens" if self.token_param == "max_completion_tokens" else "max_completion_tokens"
        )
        body.pop(other, None)
        body[self.token_param] = max_tokens

    def _switch_token_param(self, exc: E.ProviderError) -> bool:
        """The model rejected the token-limit parameter: use the other one, once per engine."""
        if self.token_param_switched or exc.unsupported_param != self.token_param:
            return False
        old = self.token_param
        self.token_param = "max_completion_tokens" if old == "max_tokens" else "max_tokens"
        self.token_param_switched = True
        log.warning(
            "Model %r rejects %s; sending %s instead (set it in params to skip this).",
            self.s.model,
            old,
            self.token_param,
        )
        return True

    async def run_one(self, req: ChatRequest) -> ChatResult:
        """One request through validation, limiter, retries. Never raises for provider errors."""
        if req.error is not None:
            return _failed(req, *req.error)
        prepared = self._prepare(req)
        if isinstance(prepared, ChatResult):
            return prepared
        body, estimate, max_tokens = prepared
        deadline = req.deadline
        if deadline is None and self.s.deadline_s is not None:
            deadline = time.monotonic() + self.s.deadline_s
        self.breaker.row_started()
        st = _Attempts(estimate=estimate)
        signatures: set[str] = set()
        while True:
            if self.breaker.reason:
                return _failed(
                    req, E.ABORTED, f"not sent: {self.breaker.reason}", attempts=st.attempt
                )
            if deadline is not None and time.monotonic() >= deadline:
                return self._deadline(req, st)
            try:
                grant = await self._wait_for_slot(estimate, deadline, st)
            except E.LimiterUnavailableError as exc:
                return _failed(
                    req,
                    E.LIMITER_UNAVAILABLE,
                    str(exc.description),
                    attempts=st.attempt,
                    rate_limit_wait_s=st.waited,
                    http_429=st.n429,
                )
            if grant is None or (deadline is not None and time.monotonic() >= deadline):
                return self._deadline(req, st)  # every send checks the deadline first
            if self.breaker.reason:
                await self._refund(grant, estimate)
                continue
            st.attempt += 1
            self._set_token_param(body, max_tokens)
            timeout = self.s.request_timeout_s
            if deadline is not None:
                timeout = max(0.001, min(timeout, deadline - time.monotonic()))
            started = time.perf_counter()
            try:
                resp = await self.transport.chat(body, timeout)
            except E.ProviderError as exc:
                st.last = exc
                delay = await self._on_error(exc, grant, st, signatures)
                if delay is None:
                    return _failed(
                        req,
                        exc.error_class,
                        exc.message,
                        attempts=st.attempt,
                        estimated_tokens=estimate,
                        rate_limit_wait_s=st.waited,
                        http_429=st.n429,
                    )
                if deadline is not None and time.monotonic() + delay >= deadline:
                    return self._deadline(req, st)
                await asyncio.sleep(delay)
                continue
            latency_ms = (time.perf_counter() - started) * 1000
            self.breaker.success()
            await self._after_answer(estimate, max_tokens, resp)
            prompt_tokens, completion_tokens, estimated = self._usage_or_estimate(
                estimate, max_tokens, resp
            )
            return ChatResult(
                req.id,
                "ok",
                response=resp.content,
                finish_reason=resp.finish_reason,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                latency_ms=latency_ms,
                attempts=st.attempt,
                estimated_tokens=estimate,
                rate_limit_wait_s=st.waited,
                http_429=st.n429,
                tokens_estimated=estimated,
                cached_tokens=resp.usage.cached_tokens if resp.usage else None,
                reasoning_tokens=resp.usage.reasoning_tokens if resp.usage else None,
            )

    async def _wait_for_slot(
        self, estimate: int, deadline: float | None, st: _Attempts
    ) -> Grant | None:
        """Acquire and sleep until the slot; None if the deadline would pass first.

        A slot is given back and a fresh one taken when the task woke more than the burst
        after it (an event-loop stall: sending on it would exceed the limit) or when a shared
        pause began after it was granted (the held requests must not all go when it ends)."""
        if self.limiter is None:
            return Grant(0.0, 1.0, True, 1.0, 0)
        for _ in range(C.MAX_FRESH_SLOTS):
            epoch = self._pause_epoch
            grant = await self.limiter.acquire(estimate, deadline=deadline)
            if deadline is not None and time.monotonic() + grant.wait_s > deadline:
                if grant.granted:  # a deferral held no shared slot: nothing to give back
                    await self._refund(grant, estimate)
                return None
            due = time.monotonic() + grant.wait_s
            woke = False
            if grant.wait_s > self.limiter.settings.burst_s:
                woke = await self._sleep_unless_burst_grows(grant.wait_s)
            elif grant.wait_s > 0:
                await asyncio.sleep(grant.wait_s)
            st.waited += grant.wait_s - max(0.0, due - time.monotonic())
            hold = self._paused_until - time.monotonic()
            stale = woke or epoch != self._pause_epoch or hold > 0
            late = time.monotonic() - due > self.limiter.settings.burst_s
            if not stale and not late:
                return grant
            await self._refund(grant, estimate)
            if hold > 0:
                st.waited += hold
                await asyncio.sleep(hold)
        return grant

    async def _sleep_unless_burst_grows(self, seconds: float) -> bool:
        """Sleep; True if woken early because the burst grew (the slot may now be too late)."""
        event = self._burst_grew
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except TimeoutError:
            return False
        return True

    async def _refund(self, grant: Grant, estimate: int) -> None:
        if self.limiter is not None and grant.granted:
            try:
                await self.limiter.reconcile(-estimate, -1)
            except E.LimiterUnavailableError:
                pass  # the slot lapses with the schedule

    async def _on_error(
        self, exc: E.ProviderError, grant: Grant, st: _Attempts, signatures: set[str]
    ) -> float | None:
        """Count the error; the delay before the next attempt, or None if the row fails."""
        if exc.status == 429 and exc.error_class not in E.NOT_RATE_SIGNALS:
            st.n429 += 1
            hint = exc.retry_after_s if exc.hint_exact else None
            if hint and hint > C.MAX_SHARED_PAUSE_S:
                hint = None  # a longer hint delays only this row (its backoff below)
            # Pause this engine's held requests too (the limiter pauses the others).
            if hint and time.monotonic() + hint > self._paused_until:
                self._paused_until = time.monotonic() + hint
                self._pause_epoch += 1
            if self.limiter is not None:
                try:
                    await self.limiter.penalize(retry_after_s=hint, slot_ms=grant.slot_ms)
                except E.LimiterUnavailableError:
                    pass  # the retry's acquire will report it
        if self._switch_token_param(exc):
            return 0.0
        self.breaker.error(exc, signatures)
        if not exc.retryable or st.attempt >= self.s.max_attempts:
            return None
        rate_limited = exc.status == 429 and exc.error_class == E.RATE_LIMITED
        if not rate_limited and not self.breaker.take_retry():
            exc.message += " (the run's retry budget is spent)"
            return None
        return backoff_delay(st.attempt, exc.retry_after_s, exact=exc.hint_exact)

    def _deadline(self, req: ChatRequest, st: _Attempts) -> ChatResult:
        why = f" (last error: {st.last.message})" if st.last else ""
        return _failed(
            req,
            E.DEADLINE_EXCEEDED,
            f"deadline passed before the request could be sent{why}",
            attempts=st.attempt,
            rate_limit_wait_s=st.waited,
            http_429=st.n429,
            estimated_tokens=st.estimate,
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

    async def _after_answer(self, estimate: int, max_tokens: int, resp: ChatResponse) -> None:
        """Feed the provider's state back: its limit headers, and the reservation's error."""
        if self.limiter is None:
            return
        limits = parse_limits(resp.headers)
        if not limits.empty:
            try:
                burst = await self.limiter.observe(limits)
            except E.LimiterUnavailableError:
                burst = self._burst_s
            if burst > 1.5 * self._burst_s:
                self._burst_s = burst
                self._burst_grew.set()
                self._burst_grew = asyncio.Event()
            elif burst < self._burst_s:
                self._burst_s = burst
        if resp.usage is None:
            return
        answer = max_tokens
        if self.s.refund_unused_completion:
            answer = resp.usage.completion_tokens
        delta = resp.usage.prompt_tokens + answer - estimate
        if delta:
            try:
                await self.limiter.reconcile(delta)
            except E.LimiterUnavailableError:
                self.limiter.warn("reconcile", "Could not reconcile %+d tokens.", delta)


@dataclass(slots=True)
class _Attempts:
    """What one request's attempts have accumulated."""

    estimate: int
    attempt: int = 0
    waited: float = 0.0
    n429: int = 0
    last: E.ProviderError | None = None


async def _aiter(
    items: Iterable[ChatRequest] | AsyncIterable[ChatRequest],
) -> AsyncIterator[ChatRequest]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
