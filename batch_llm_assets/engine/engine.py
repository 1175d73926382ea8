"""The async engine: many chat requests in, one result record per request out.

Per request: validate and estimate (no network for bad input), acquire from the shared limiter,
sleep once, send, reconcile the reservation with the usage, and retry what can be retried.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from .outcome import TRUNCATED, classify_answer, tools_requested
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
    cached_tokens: int | None = None  # prompt tokens the provider billed at its cached rate

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
        self._waiters = 0  # requests now waiting for the limiter
        self._wait_since = 0.0
        self._wait_total = 0.0
        encoding_for(settings.model)  # load tiktoken's files now, not inside the first request

    @property
    def limiter_wait_s(self) -> float:
        """Wall time during which at least one request waited for the limiter (not a sum over
        requests: 64 requests waiting the same second count one second)."""
        ongoing = time.monotonic() - self._wait_since if self._waiters else 0.0
        return self._wait_total + ongoing

    async def _wait_for_limiter(self, seconds: float) -> None:
        if self._waiters == 0:
            self._wait_since = time.monotonic()
        self._waiters += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self._waiters -= 1
            if self._waiters == 0:
                self._wait_total += time.monotonic() - self._wait_since

    @property
    def aborted_reason(self) -> str | None:
        """Why the batch stopped sending (repeated authentication / not-found errors), if it did."""
        return self._fatal

    async def map(
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
        source = _aiter(requests)
        # Bounded: while the consumer is busy, workers wait instead of piling up results.
        n = max(1, self.s.max_concurrency)
        out: asyncio.Queue[Any] = asyncio.Queue(maxsize=n)
        lock = asyncio.Lock()
        stopping = False

        async def worker() -> None:
            nonlocal stopping
            me = asyncio.current_task()
            assert me is not None
            try:
                while not stopping:
                    async with lock:
                        if stopping:
                            break
                        try:
                            req = await anext(source)
                        except StopAsyncIteration:
                            break
                    result = await self.run_one(req)
                    if on_result is not None:
                        on_result(result)
                    if stopping or me.cancelling():  # the consumer is gone; a library
                        return  # below may have swallowed the cancel: do not wait on the queue
                    await out.put(result)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # the source, the hook, or a bug: stop sending, report
                stopping = True
                await out.put(_WorkerFailed(exc))
                return
            if not me.cancelling():
                await out.put(_DONE)

        tasks = [asyncio.create_task(worker()) for _ in range(n)]
        try:
            finished = 0
            while finished < n:
                item = await out.get()
                if item is _DONE:
                    finished += 1
                elif isinstance(item, _WorkerFailed):
                    raise item.exc
                else:
                    yield item
        finally:
            stopping = True
            pending = set(tasks)
            while pending:
                for t in pending:
                    t.cancel()
                while not out.empty():  # wake any worker blocked on the full queue
                    out.get_nowait()
                _, pending = await asyncio.wait(pending, timeout=1.0)
            await _close(source)

    def request_body(
        self, messages: list[dict[str, Any]], params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The exact JSON body sent for these messages, every default applied (pure)."""
        body = {**self.s.params, **(params or {}), "model": self.s.model, "messages": messages}
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = requested_max_tokens(body, self.s.default_max_tokens)
        return body

    def _prepare(self, req: ChatRequest) -> tuple[dict[str, Any], int, int] | ChatResult:
        """(body, estimate, max_tokens), or the failed result of a request not to send."""
        messages = req.messages
        user = [m for m in messages or () if m.get("role") == "user"]
        if not user or any(_blank(m.get("content")) for m in user):
            return _failed(req, E.EMPTY_PROMPT, "prompt is null or empty; not sent")
        body = self.request_body(messages or [], req.params)
        max_tokens = requested_max_tokens(body, self.s.default_max_tokens)
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
        # A truncated answer is invalid JSON: it is repaired or fails invalid_output (issue 12).
        if req.validate is not None and (result.ok or result.error_class == TRUNCATED):
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
        first_send: float | None = None
        empty_retried = False
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
                        await self._wait_for_limiter(grant.wait_s)
                    # Granted before a 429 was seen here: still wait out the server's hint.
                    hold = self._paused_until - time.monotonic()
                    if hold > 0:
                        waited += hold
                        await self._wait_for_limiter(hold)
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
            first_send = first_send or started
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
                        total_ms=(time.perf_counter() - first_send) * 1000,
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
            ended = time.perf_counter()
            self._fatal_streak = 0
            await self._reconcile(estimate, max_tokens, resp)
            verdict = classify_answer(
                resp, tools_allowed=tools_requested(body), max_tokens=max_tokens
            )
            if verdict.retry and not empty_retried:  # billable: once, never max_attempts times
                empty_retried = True
                continue
            return ChatResult(
                req.id,
                verdict.status,
                response=verdict.response,
                finish_reason=resp.finish_reason,
                refusal=resp.refusal,
                error_class=verdict.error_class,
                error_message=verdict.message,
                prompt_tokens=resp.prompt_tokens,
                completion_tokens=resp.completion_tokens,
                latency_ms=(ended - started) * 1000,
                total_ms=(ended - first_send) * 1000,
                attempts=attempt,
                estimated_tokens=estimate,
                rate_limit_wait_s=waited,
                http_429=n429,
                model=resp.model,
                cached_tokens=resp.cached_tokens,
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


class _WorkerFailed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_DONE = object()


async def _aiter(
    items: Iterable[ChatRequest] | AsyncIterable[ChatRequest],
) -> AsyncIterator[ChatRequest]:
    """One async view of the input; closes the caller's generator when the batch ends early."""
    try:
        if isinstance(items, AsyncIterable):
            async for item in items:
                yield item
        else:
            for item in items:
                yield item
    finally:
        await _close(items)


async def _close(items: Any) -> None:
    aclose = getattr(items, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
    close = getattr(items, "close", None)
    if close is not None and aclose is None:
        with contextlib.suppress(Exception):
            close()
