"""The async engine: many chat requests in, one result record per request out.

Per request: validate and estimate (no network for bad input), acquire from the shared limiter,
sleep once (a fresh slot if it woke late or a pause came in between), check the deadline, send,
reconcile the reservation with the usage and feed the provider's headers back, and retry what
can be retried within the run's retry budget. The breaker stops a run that can only fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import random
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from . import _constants as C
from . import errors as E
from . import structured as S
from .breaker import Breaker
from .limiter import Grant, RedisLimiter
from .outcome import TRUNCATED, classify_answer, tools_requested
from .profiles import token_param_for
from .provider_gate import ProviderGate, RemainingViews
from .tokens import (
    count_prompt_tokens,
    count_text_tokens,
    encoding_for,
    requested_max_tokens,
    uses_fallback_encoding,
)
from .transport import ChatResponse, ChatTransport
from .usage import ProviderLimits, parse_limits

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


def _has_user_prompt(messages: list[dict[str, Any]]) -> bool:
    """At least one user message, and none of them blank."""
    found = False
    for m in messages:
        if m.get("role") == "user":
            if _blank(m.get("content")):
                return False
            found = True
    return found


_NON_FINITE = "hold a NaN or infinite number, which JSON cannot carry"


def _non_finite(value: Any) -> bool:
    """A NaN or infinity anywhere in request params (a temperature from a bad row, say)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_non_finite(v) for v in value)
    return False


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
        if _non_finite(settings.params):
            raise ValueError(f"The engine's params {_NON_FINITE}.")
        self.s = settings
        self.transport = transport
        self.limiter = limiter
        self._feedback: set[asyncio.Task[None]] = set()
        self.breaker = Breaker(
            threshold=settings.breaker_threshold,
            fatal_threshold=settings.fatal_error_threshold,
            retry_budget_base=settings.retry_budget_base,
            retry_budget_ratio=settings.retry_budget_ratio,
        )
        self._paused_until = 0.0
        self._waiters = 0  # requests now waiting for the limiter
        self._wait_since = 0.0
        self._wait_total = 0.0
        self._pause_epoch = 0  # bumped by every shared pause: slots granted before it are stale
        self._paused_at = -math.inf  # when the latest one began (time.monotonic())
        # Requests sleeping on their slots; woken to take fresh ones: when the
        # provider's headers widen the burst (the fresh slot may be now), and after a 429 (slots
        # granted at the old rate are given back together, then taken again, paced, from the
        # pause's end: one at a time, each would take back the slot just given up, all the same).
        self._sleepers: dict[asyncio.Future[int], tuple[Grant, int]] = {}  # slot, estimate
        self._giving_back: asyncio.Future[None] | None = None  # sleepers' slots going back
        # Sleepers whose slots a wider burst's wake is moving: the call, their place in it, and
        # the wake's number.
        self._reslotting: dict[asyncio.Future[int], tuple[asyncio.Future[list[Grant]], int, int]]
        self._reslotting = {}
        self._moving: set[asyncio.Future[list[Grant]]] = set()  # those calls
        self._reslot_soon: asyncio.TimerHandle | None = None
        self._wakes = 0
        self._burst_s = limiter.settings.burst_s if limiter is not None else 0.0
        # Provider's prompt tokens per estimated one, learned from usage: a provider that counts
        # otherwise (characters/4 of the body, another tokenizer) is reserved what it will
        # charge, so the schedule is right before the answers reconcile it.
        self._calibration = 1.0
        self._calibrated = 0
        self._calibration_sums = [0.0, 0.0]  # provider's prompt tokens, estimated (fading)
        # Tokens (reserved) and requests sent since the start: what went after a request is
        # what its answer's x-ratelimit-remaining cannot show yet.
        self._sent = [0, 0]
        # The same sends for the provider gate: estimated prompt tokens, requests, max_tokens.
        # The gate weighs the first at the calibration it has now, not the one at the send.
        self._gate_sent = [0, 0, 0]
        self._remaining = RemainingViews()  # what the latest answers say remains (limiter)
        # The most tokens sent up to an answer whose remaining the schedule was raised to: the
        # provider's count of those sends is in the schedule now (see `_after_answer`).
        self._clamped_seen = 0
        # What the provider's headers say it can take now, held against those sends.
        self._gate = ProviderGate(rpm=limiter.rpm, tpm=limiter.tpm) if limiter is not None else None
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
    def limiter_wait_s(self) -> float:
        """Wall time during which at least one request waited for the limiter (not a sum over
        requests: 64 requests waiting the same second count one second)."""
        ongoing = time.monotonic() - self._wait_since if self._waiters else 0.0
        return self._wait_total + ongoing

    def _begin_wait(self) -> None:
        if self._waiters == 0:
            self._wait_since = time.monotonic()
        self._waiters += 1

    def _end_wait(self) -> None:
        self._waiters -= 1
        if self._waiters == 0:
            self._wait_total += time.monotonic() - self._wait_since

    @property
    def aborted_reason(self) -> str | None:
        """Why the batch stopped sending (breaker tripped), if it did."""
        return self.breaker.reason

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
        self._set_token_param(body, requested_max_tokens(body, self.s.default_max_tokens))
        return body

    def _prepare(self, req: ChatRequest) -> tuple[dict[str, Any], int, int] | ChatResult:
        """(body, estimate, max_tokens), or the failed result of a request not to send."""
        messages = req.messages
        if not messages or not _has_user_prompt(messages):
            return _failed(req, E.EMPTY_PROMPT, "prompt is null or empty; not sent")
        if req.params and _non_finite(req.params):
            return _failed(req, E.BAD_REQUEST, f"params {_NON_FINITE}; not sent")
        body = {**self.s.params, **req.params} if req.params else self.s.params.copy()
        body["model"] = self.s.model
        body["messages"] = messages
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
        self.breaker.row_started()
        st = _Attempts(estimate=estimate)
        signatures: set[str] = set()
        first_send: float | None = None
        empty_retried = False
        while True:
            if self.breaker.reason:
                return _failed(
                    req, E.ABORTED, f"not sent: {self.breaker.reason}", attempts=st.attempt
                )
            if deadline is not None and time.monotonic() >= deadline:
                return self._deadline(req, st)
            reserve = self._reservation(estimate, max_tokens)
            try:
                self._begin_wait()
                try:
                    grant = await self._wait_for_slot(reserve, deadline, st)
                finally:
                    self._end_wait()
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
            if self._gate is not None and not await self._hold_for_provider(reserve, deadline):
                return self._deadline(req, st)
            if self.breaker.reason:
                await self._refund(grant, reserve)
                continue
            # From the provider gate's check to the count of this send: no await in between.
            st.attempt += 1
            self._set_token_param(body, max_tokens)
            timeout = self.s.request_timeout_s
            if deadline is not None:
                timeout = max(0.001, min(timeout, deadline - time.monotonic()))
            started = time.perf_counter()
            first_send = first_send or started
            sent_at = time.monotonic()
            sent, gate_sent = self._sent, self._gate_sent
            sent[0] += reserve
            sent[1] += 1
            seen = (sent[0], sent[1])
            gate_sent[0] += estimate - max_tokens
            gate_sent[1] += 1
            gate_sent[2] += max_tokens
            gate_seen = tuple(gate_sent)
            try:
                resp = await self.transport.chat(body, timeout)
            except E.ProviderError as exc:
                st.last = exc
                if exc.status == 429 and self._gate is not None:
                    self._gate.observe(parse_limits(exc.headers), sent_at, gate_seen)
                    self._gate.rejected()
                # Typed outputs: a provider that refuses the JSON form refuses every row alike.
                rejected = req.validate is not None and S.rejects_structured(exc)
                if rejected:
                    self.breaker.fatal_error(exc)
                    delay = None
                else:
                    delay = await self._on_error(exc, grant, st, signatures)
                if delay is None:
                    return _failed(
                        req,
                        E.STRUCTURED_UNSUPPORTED if rejected else exc.error_class,
                        S.rejection_message(exc) if rejected else exc.message,
                        total_ms=(time.perf_counter() - first_send) * 1000,
                        attempts=st.attempt,
                        estimated_tokens=estimate,
                        rate_limit_wait_s=st.waited,
                        http_429=st.n429,
                    )
                if deadline is not None and time.monotonic() + delay >= deadline:
                    return self._deadline(req, st)
                await asyncio.sleep(delay)
                continue
            ended = time.perf_counter()
            self.breaker.success()
            self._feed_back(estimate, reserve, max_tokens, resp, seen, (sent_at, gate_seen))
            prompt_tokens, completion_tokens, estimated = self._usage_or_estimate(
                estimate, max_tokens, resp
            )
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
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                latency_ms=(ended - started) * 1000,
                total_ms=(ended - first_send) * 1000,
                attempts=st.attempt,
                estimated_tokens=estimate,
                rate_limit_wait_s=st.waited,
                http_429=st.n429,
                model=resp.model,
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
        given_up: Grant | None = None  # a slot to give back once the fresh one is held
        for attempt in range(C.MAX_FRESH_SLOTS):
            last = attempt == C.MAX_FRESH_SLOTS - 1
            if self._giving_back is not None:  # the old slots go back before any fresh one
                await asyncio.shield(self._giving_back)
            wakes = self._wakes
            grant = await self.limiter.acquire(estimate, deadline=deadline)
            if given_up is not None:
                await self._refund(given_up, estimate)
                given_up = None
            if deadline is not None and time.monotonic() + grant.wait_s > deadline:
                if grant.granted:  # a deferral held no shared slot: nothing to give back
                    await self._refund(grant, estimate)
                return None
            slept_from = time.monotonic()
            due = slept_from + grant.wait_s
            # Sleepers were woken while this acquire was on its way: its slot is as stale.
            woke = _WOKEN if self._wakes != wakes and grant.wait_s > 0 and not last else _SLEPT
            if grant.wait_s > 0 and not woke:
                # On its last slot a task is not woken: it could only send early on it.
                woke, grant, due = await self._sleep_unless_reslot(
                    grant, estimate, due, wakeable=not last
                )
            st.waited += min(time.monotonic(), due) - slept_from
            hold = self._paused_until - time.monotonic()
            # Stale: granted before a pause began (a deferral inside acquire does not count).
            stale = woke or self._paused_at >= grant.asked_at or hold > 0
            late = time.monotonic() - due > self.limiter.settings.burst_s
            if not stale and not late:
                return grant
            if woke == _GIVEN_BACK:
                pass  # with every other sleeper's, in one call (see `_wake_sleepers`)
            elif not last and woke and hold <= 0 and not late and grant.share >= 1:
                # Woken by a wider burst: the slot is given back once the fresh one is held. A
                # refund first left the schedule short for a moment, and an observe in that
                # moment clamped it there (to what the provider showed): the fresh acquire then
                # counted the request twice (up to a second of a minute's bucket, per wave).
                # Only for the one job on the key: with others, the refund's credit is what
                # lets the fresh acquire past the job's share.
                given_up = grant
            elif not last:
                await self._refund(grant, estimate)
            if hold > 0:
                st.waited += hold
                await asyncio.sleep(hold)
            if last:
                # Out of fresh slots: this one is used, and so not given back (a refunded
                # slot sent on would be one request more than the schedule holds).
                return grant
        raise AssertionError("unreachable: the last fresh slot is returned")

    async def _sleep_unless_reslot(
        self, grant: Grant, estimate: int, due: float, *, wakeable: bool
    ) -> tuple[int, Grant, float]:
        """Sleep until the slot: how the sleep ended (`_SLEPT`, or `_WOKEN` / `_GIVEN_BACK` if
        woken early to take a fresh one; see `_sleepers`), and the slot slept on with its due
        time (a wider burst's wake moves it: `_wake_sleepers`)."""
        if not wakeable:
            await asyncio.sleep(grant.wait_s)
            return _SLEPT, grant, due
        loop = asyncio.get_running_loop()
        while True:
            woken = loop.create_future()
            timer = loop.call_later(max(0.0, due - time.monotonic()), _resolve, woken, _SLEPT)
            self._sleepers[woken] = (grant, estimate)
            try:
                how = await woken
            finally:
                timer.cancel()
                self._sleepers.pop(woken, None)
            if how != _RESLOTTING:
                return how, grant, due
            batch, index, wakes = self._reslotting.pop(woken)
            try:
                grant = (await asyncio.shield(batch))[index]
            except E.LimiterUnavailableError:
                continue  # the old slot holds
            due = time.monotonic() + grant.wait_s
            if self._wakes != wakes:  # a 429's wake came while the call was on its way
                return _WOKEN, grant, due

    async def _hold_for_provider(self, reserve: int, deadline: float | None) -> bool:
        """Wait while the provider's headers say it cannot take this send yet (a window
        before its reset, a bucket the provider counts otherwise); False if the deadline
        would pass first."""
        assert self._gate is not None
        while (wait := self._gate.wait_s(reserve, time.monotonic(), self._gate_sent)) > 0:
            if deadline is not None and time.monotonic() + wait >= deadline:
                return False
            await asyncio.sleep(min(wait, C.MAX_SHARED_PAUSE_S))
        return True

    def _wake_sleepers(self, *, after_429: bool = False) -> None:
        """Wake every sleeper to take a fresh slot. After a 429 their old slots go back first,
        in one call: given back one by one, each interleaved with fresh acquires (one task's
        own, or another's), a refund pulled the schedule's end back under slots just granted,
        which the next acquires were granted again (seven sends within 2 ms, after 2.7 s with
        none, and a 429 storm: 1,100-1,400 429s for 240 requests)."""
        self._reslot_soon = None
        self._wakes += 1
        woken_as = _WOKEN
        if not after_429 and self.limiter is not None:
            # A wider burst: a job alone on the key has its sleepers' slots moved in one call.
            held = sorted(
                ((f, g, e) for f, (g, e) in self._sleepers.items() if not f.done()),
                key=lambda x: x[1].slot_ms,
            )
            held = [(f, g, e) for f, g, e in held if g.granted and g.share >= 1 and g.slot_ms]
            if held:
                batch = self._move([g for _, g, _ in held], [e for _, _, e in held])
                for index, (woken, _, _) in enumerate(held):
                    self._reslotting[woken] = (batch, index, self._wakes)
                    _resolve(woken, _RESLOTTING)
        if after_429 and self.limiter is not None:
            held = [(g, e) for f, (g, e) in self._sleepers.items() if not f.done() and g.granted]
            if held:
                tokens, requests = sum(e for _, e in held), len(held)
                self._giving_back = asyncio.ensure_future(
                    self._refund_all(self._giving_back, tokens, requests)
                )
                woken_as = _GIVEN_BACK
        for woken in self._sleepers:
            _resolve(woken, woken_as)
        self._sleepers.clear()

    def _move(self, held: list[Grant], costs: list[int]) -> asyncio.Future[list[Grant]]:
        assert self.limiter is not None
        task = asyncio.ensure_future(self.limiter.reslot(held, costs))
        self._moving.add(task)
        task.add_done_callback(self._moved)
        return task

    def _moved(self, batch: asyncio.Future[list[Grant]]) -> None:
        self._moving.discard(batch)
        if not batch.cancelled():
            batch.exception()  # seen: its sleepers keep their old slots

    async def _refund_all(
        self, before: asyncio.Future[None] | None, tokens: int, requests: int
    ) -> None:
        if before is not None:
            await asyncio.shield(before)
        assert self.limiter is not None
        try:
            await self.limiter.reconcile(-tokens, -requests)
        except E.LimiterUnavailableError:
            pass  # the slots lapse with the schedule
        finally:
            if self._giving_back is asyncio.current_task():
                self._giving_back = None

    def _wake_sleepers_soon(self) -> None:
        """Wake the sleepers once the 429s of one burst have all arrived (they come within
        milliseconds), not once per 429: a second wave would interleave its refunds with the
        first wave's fresh acquires."""
        if self._reslot_soon is None:
            loop = asyncio.get_running_loop()
            self._reslot_soon = loop.call_later(
                C.RESLOT_DEBOUNCE_S, functools.partial(self._wake_sleepers, after_429=True)
            )

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
                self._paused_at = time.monotonic()
            if self.limiter is not None:
                try:
                    await self.limiter.penalize(retry_after_s=hint, slot_ms=grant.slot_ms)
                except E.LimiterUnavailableError:
                    pass  # the retry's acquire will report it
                self._wake_sleepers_soon()
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

    def _feed_back(
        self,
        estimate: int,
        reserve: int,
        max_tokens: int,
        resp: ChatResponse,
        seen: tuple[int, int],
        gate_seen: tuple[float, tuple[int, ...]],
    ) -> None:
        """Start `_after_answer` beside the row, not before it: the answer goes to the caller
        (the journal) at once, never after a wait on Redis. `drain` awaits what is left. The
        provider gate learns from the headers at once."""
        if self.limiter is None or self._gate is None:
            return
        if resp.usage is not None:
            self._calibrate(estimate, max_tokens, resp.usage.prompt_tokens)
        limits = parse_limits(resp.headers)
        if not limits.empty:
            # At the rate the limiter paces at now: the configured one may be over the
            # provider's (with no x-ratelimit-limit to say so), and the gate refilled the
            # provider's bucket at it: one 429 after another, each cutting a rate the gate
            # did not use. The 429s' decreases now slow the gate too.
            f = self.limiter.factor
            self._gate.set_rates(
                rpm=int(self.limiter.rpm * f) if self.limiter.rpm else None,
                tpm=int(self.limiter.tpm * f) if self.limiter.tpm else None,
            )
            self._gate.observe(limits, *gate_seen)
            self.limiter.window_s = self._gate.window_s
            # Alone on the key only: others' sends move the resets too, not in this count.
            lower = self._gate.refill_limits(rpm=self.limiter.rpm, tpm=self.limiter.tpm)
            if lower and self.limiter.only_engine:
                self.limiter.adopt_refill(**lower)
        task = asyncio.ensure_future(
            self._after_answer(estimate, reserve, max_tokens, resp, limits, seen, gate_seen[0])
        )
        self._feedback.add(task)
        task.add_done_callback(self._feedback_done)

    def _feedback_done(self, task: asyncio.Task[None]) -> None:
        self._feedback.discard(task)
        if not task.cancelled() and task.exception() is not None and self.limiter is not None:
            exc = task.exception()
            self.limiter.warn("feedback", "Could not feed an answer back to the limiter: %r", exc)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait (bounded) for the limiter feedback of answers already returned."""
        if self._feedback:
            await asyncio.wait(set(self._feedback), timeout=timeout_s)

    def _reservation(self, estimate: int, max_tokens: int) -> int:
        """What a request reserves: the prompt estimate scaled to the provider's own count."""
        if self._calibration == 1.0 or self.limiter is None:
            return estimate
        reserve = math.ceil((estimate - max_tokens) * self._calibration) + max_tokens
        return min(reserve, self.limiter.max_request_tokens or reserve)

    def _calibrate(self, estimate: int, max_tokens: int, usage_prompt: int) -> None:
        """Learn the provider's prompt tokens per estimated one: the ratio of the sums over
        the latest answers (`CALIBRATION_ANSWERS`), so one odd prompt moves it little."""
        prompt = estimate - max_tokens
        if prompt <= 0 or usage_prompt <= 0:
            return
        self._calibrated += 1
        if self._calibrated >= C.CALIBRATION_SETTLED and self.limiter is not None:
            self.limiter.settled = True
        sums, keep = self._calibration_sums, 1 - 1 / C.CALIBRATION_ANSWERS
        sums[0] = sums[0] * keep + usage_prompt
        sums[1] = sums[1] * keep + prompt
        ratio = sums[0] / sums[1]
        self._calibration = min(C.CALIBRATION_MAX, max(C.CALIBRATION_MIN, ratio))
        if self._gate is not None:
            self._gate.set_scale(self._calibration)

    async def _after_answer(
        self,
        estimate: int,
        reserve: int,
        max_tokens: int,
        resp: ChatResponse,
        limits: ProviderLimits,
        seen: tuple[int, int],
        sent_at: float,
    ) -> None:
        """Feed the provider's state back: its limit headers, and the reservation's error.

        `seen`: the tokens and requests this engine had sent when this request went; what it
        sent after it the provider had not counted yet, so it comes off the remaining the answer
        reports. (Requests sleeping on later slots are in the schedule already.)"""
        if self.limiter is None:
            return
        # The reservation's error first, then the provider's state. A schedule raised to what
        # the provider says remains holds the provider's own count of every send up to that
        # answer; a reconcile of one of them after it counted its error twice (a third of the
        # first burst's tokens under characters/4 counting: 0.1-0.3 s of a job on a 10 s
        # bucket). For the only engine on the key, whose sends are all the provider counted.
        counted = self.limiter.only_engine and seen[0] <= self._clamped_seen
        if resp.usage is not None and not counted:
            answer = max_tokens
            if self.s.refund_unused_completion:
                answer = resp.usage.completion_tokens
            delta = resp.usage.prompt_tokens + answer - reserve
            if delta:
                try:
                    await self.limiter.reconcile(delta)
                except E.LimiterUnavailableError:
                    self.limiter.warn("reconcile", "Could not reconcile %+d tokens.", delta)
        if not limits.empty:
            # Only for the one engine on the key: others' sends since an older view are not in it.
            limits = self._remaining.of(
                limits,
                sent_at,
                seen,
                self.limiter.tpm,
                self.limiter.rpm,
                use=self.limiter.only_engine,
            )
            limits = _less_unseen(
                limits,
                self._sent[0] - seen[0],
                self._sent[1] - seen[1],
                self.limiter.tpm,
                self.limiter.rpm,
            )
            try:
                burst = await self.limiter.observe(limits, sent_at=sent_at)
            except E.LimiterUnavailableError:
                burst = self._burst_s
            else:
                if self.limiter.clamped_tokens and self.limiter.only_engine:
                    self._clamped_seen = max(self._clamped_seen, seen[0])
            # Wake on a real widening only (a half, or a configured burst more: 54 s to 59.95 s
            # on a minute's bucket is 28 requests that would otherwise wait on slots of the old
            # burst); the same step the other way counts as a narrowing, so header jitter
            # never wakes anyone.
            step = self.limiter.settings.burst_s
            if burst > 1.5 * self._burst_s or burst >= self._burst_s + step:
                self._burst_s = burst
                self._wake_sleepers()
            elif burst <= self._burst_s - step or burst <= step:
                self._burst_s = burst


# How a sleep on a slot ended: at the slot, woken to take a fresh one, woken with the slot
# given back already, or woken while a wider burst's wake moves the slot (`_wake_sleepers`).
_SLEPT, _WOKEN, _GIVEN_BACK, _RESLOTTING = 0, 1, 2, 3


def _resolve(future: asyncio.Future[int], value: int) -> None:
    if not future.done():
        future.set_result(value)


def _less_unseen(
    limits: ProviderLimits, tokens: int, requests: int, tpm: int | None, rpm: int | None
) -> ProviderLimits:
    """The provider's remaining tokens and requests less what it could not have counted yet.

    Below zero when more is in flight than the provider showed left: a debt the schedule must
    hold. Floored at zero, the clamp lost the excess exactly when the bucket was at its edge
    (with 20 ms answers, three or four sends in flight against a remaining of one or two), and
    let the provider's bucket run under one request. The reset grows by the time the rate takes
    to refill what is taken off, so remaining + reset x rate, the bucket's capacity the limiter
    learns its burst from, stays what the provider showed."""
    rt, rr = limits.remaining_tokens, limits.remaining_requests
    st, sr = limits.reset_tokens_s, limits.reset_requests_s
    tokens, requests = max(0, tokens), max(0, requests)
    return replace(
        limits,
        remaining_tokens=None if rt is None else rt - tokens,
        remaining_requests=None if rr is None else rr - requests,
        reset_tokens_s=st + tokens * 60 / tpm if st is not None and tpm else st,
        reset_requests_s=sr + requests * 60 / rpm if sr is not None and rpm else sr,
    )


@dataclass(slots=True)
class _Attempts:
    """What one request's attempts have accumulated."""

    estimate: int
    attempt: int = 0
    waited: float = 0.0
    n429: int = 0
    last: E.ProviderError | None = None


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
