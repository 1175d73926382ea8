"""The async engine: many chat requests in, one result record per request out.

Per request: validate and estimate (no network for bad input), acquire from the shared limiter,
sleep once, send, reconcile the reservation with the usage, and retry what can be retried.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import _constants as C
from . import errors as E
from . import structured as S
from .limiter import RedisLimiter
from .tokens import count_prompt_tokens, encoding_for, requested_max_tokens
from .transport import ChatResponse, ChatTransport

log = logging.getLogger(__name__)


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


@dataclass(slots=True)
class ChatResult:
    """What became of one request. `status` is "ok" or "failed" (then `error_class` says why)."""

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
    refusal: str | None = None

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


def backoff_delay(attempt: int, hint_s: float | None) -> float:
    """The server's hint when it gives a sane one, else capped exponential backoff with jitter."""
    if hint_s is not None and 0 <= hint_s <= C.MAX_SERVER_HINT_S:
        return hint_s
    delay = min(C.INITIAL_RETRY_DELAY_S * 2 ** (attempt - 1), C.MAX_RETRY_DELAY_S)
    return delay * (1 - C.RETRY_JITTER * random.random())


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
        self._fatal_streak = 0
        self._fatal: str | None = None
        self._limits_seen = False
        self._paused_until = 0.0
        encoding_for(settings.model)  # load tiktoken's files now, not inside the first request

    @property
    def aborted_reason(self) -> str | None:
        """Why the batch stopped sending (repeated authentication / not-found errors), if it did."""
        return self._fatal

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
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = max_tokens
        estimate = count_prompt_tokens(messages, self.s.model) + max_tokens
        window = self.s.context_window
        if window and estimate > window:
            return _failed(
                req,
                E.CONTEXT_LENGTH,
                f"prompt + max_tokens is about {estimate} tokens, over the model's context "
                f"window of {window}; not sent",
                estimated_tokens=estimate,
            )
        return body, estimate, max_tokens

    async def run_one(self, req: ChatRequest) -> ChatResult:
        """One request through validation, limiter, retries. Never raises for provider errors."""
        result = await self._send(req)
        # -- typed outputs: validate the answer, repair it (engine/structured.py) --
        if req.validate is not None and result.ok:
            return await S.validated(self._send, req, result)
        return result

    async def _send(self, req: ChatRequest) -> ChatResult:
        """One chat completion (with its retries) and its raw result."""
        if req.error is not None:
            return _failed(req, *req.error)
        prepared = self._prepare(req)
        if isinstance(prepared, ChatResult):
            return prepared
        body, estimate, max_tokens = prepared
        deadline = req.deadline
        if deadline is None and self.s.deadline_s is not None:
            deadline = time.monotonic() + self.s.deadline_s
        waited = 0.0
        n429 = 0
        attempt = 0
        last: E.ProviderError | None = None
        while True:
            if self._fatal:
                return _failed(req, E.ABORTED, f"not sent: {self._fatal}", attempts=attempt)
            if deadline is not None and time.monotonic() >= deadline:
                return self._deadline(req, attempt, last, waited, n429, estimate)
            try:
                if self.limiter is not None:
                    grant = await self.limiter.acquire(estimate, deadline=deadline)
                    if deadline is not None and time.monotonic() + grant.wait_s > deadline:
                        if grant.granted:  # a deferral held no shared slot: nothing to give back
                            await self.limiter.reconcile(-estimate, -1)
                        return self._deadline(req, attempt, last, waited, n429, estimate)
                    if grant.wait_s > 0:
                        waited += grant.wait_s
                        await asyncio.sleep(grant.wait_s)
                    # Granted before a 429 was seen here: still wait out the server's hint.
                    hold = self._paused_until - time.monotonic()
                    if hold > 0:
                        waited += hold
                        await asyncio.sleep(hold)
            except E.LimiterUnavailableError as exc:
                return _failed(
                    req,
                    E.LIMITER_UNAVAILABLE,
                    str(exc.description),
                    attempts=attempt,
                    rate_limit_wait_s=waited,
                    http_429=n429,
                )
            attempt += 1
            timeout = self.s.request_timeout_s
            if deadline is not None:
                timeout = max(0.001, min(timeout, deadline - time.monotonic()))
            started = time.perf_counter()
            try:
                resp = await self.transport.chat(body, timeout)
            except E.ProviderError as exc:
                last = exc
                if exc.status == 429:
                    n429 += 1
                    if exc.retry_after_s:
                        self._paused_until = max(
                            self._paused_until, time.monotonic() + exc.retry_after_s
                        )
                    if self.limiter is not None:
                        await self._penalize(exc)
                # Typed outputs: a provider that refuses the JSON form refuses every row alike.
                rejected = req.validate is not None and S.rejects_structured(exc)
                if exc.error_class in E.FATAL_CLASSES or rejected:
                    self._note_fatal(exc)
                if not exc.retryable or rejected or attempt >= self.s.max_attempts:
                    return _failed(
                        req,
                        E.STRUCTURED_UNSUPPORTED if rejected else exc.error_class,
                        S.rejection_message(exc) if rejected else exc.message,
                        attempts=attempt,
                        estimated_tokens=estimate,
                        rate_limit_wait_s=waited,
                        http_429=n429,
                    )
                delay = backoff_delay(attempt, exc.retry_after_s)
                if deadline is not None and time.monotonic() + delay >= deadline:
                    return self._deadline(req, attempt, last, waited, n429, estimate)
                await asyncio.sleep(delay)
                continue
            latency_ms = (time.perf_counter() - started) * 1000
            self._fatal_streak = 0
            await self._reconcile(estimate, max_tokens, resp)
            return ChatResult(
                req.id,
                "ok",
                response=resp.content,
                finish_reason=resp.finish_reason,
                prompt_tokens=resp.prompt_tokens,
                completion_tokens=resp.completion_tokens,
                latency_ms=latency_ms,
                attempts=attempt,
                estimated_tokens=estimate,
                rate_limit_wait_s=waited,
                http_429=n429,
                refusal=resp.refusal,
            )

    def _deadline(
        self,
        req: ChatRequest,
        attempts: int,
        last: E.ProviderError | None,
        waited: float,
        n429: int,
        estimate: int,
    ) -> ChatResult:
        why = f" (last error: {last.message})" if last else ""
        return _failed(
            req,
            E.DEADLINE_EXCEEDED,
            f"deadline passed before the request could be sent{why}",
            attempts=attempts,
            rate_limit_wait_s=waited,
            http_429=n429,
            estimated_tokens=estimate,
        )

    def _note_fatal(self, exc: E.ProviderError) -> None:
        self._fatal_streak += 1
        if self._fatal_streak >= self.s.fatal_error_threshold and not self._fatal:
            self._fatal = (
                f"the provider rejected {self._fatal_streak} requests in a row with "
                f"{exc.error_class} ({exc.message}); the remaining requests were not sent"
            )
            log.error("Aborting the batch: %s", self._fatal)

    async def _penalize(self, exc: E.ProviderError) -> None:
        assert self.limiter is not None
        try:
            await self.limiter.penalize(retry_after_s=exc.retry_after_s)
        except E.LimiterUnavailableError:
            pass  # the retry's acquire will report it

    async def _reconcile(self, estimate: int, max_tokens: int, resp: ChatResponse) -> None:
        """Charge or refund what the provider counted against what was reserved."""
        if self.limiter is None:
            return
        if not self._limits_seen:
            self._limits_seen = True
            self.limiter.lower_limits(
                rpm=_int(resp.headers.get("x-ratelimit-limit-requests")),
                tpm=_int(resp.headers.get("x-ratelimit-limit-tokens")),
            )
        if resp.prompt_tokens is None:
            return
        answer = max_tokens
        if self.s.refund_unused_completion and resp.completion_tokens is not None:
            answer = resp.completion_tokens
        delta = resp.prompt_tokens + answer - estimate
        if delta:
            try:
                await self.limiter.reconcile(delta)
            except E.LimiterUnavailableError:
                log.warning("Could not reconcile %+d tokens with the limiter.", delta)


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


async def _aiter(
    items: Iterable[ChatRequest] | AsyncIterable[ChatRequest],
) -> AsyncIterator[ChatRequest]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
