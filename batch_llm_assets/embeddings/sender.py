"""The embedding request flow, on the shared parts of an open Engine: its transport, its pacer (the
shared Redis limiter: a pack acquires the sum of its rows' tokens; RPM counts the request), its
breaker and retry budget, its concurrency gate, and the retry rules of the chat path
(engine/errors.py classifies, engine/requests.py backs off). Plain async: no Dagster.

One pack in, one result per row out. A pack the provider refuses as a whole for what one input
may cause (a 400, 413 or 422; too many tokens) is split in two and each half sent again, down to
the row at fault: its neighbours succeed, and it fails with the provider's reason. answers.py
reads the answers.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from ..engine import errors as E
from ..engine.breaker import Breaker
from ..engine.budget import Refused, SpendCap
from ..engine.engine import Engine
from ..engine.gate import held
from ..engine.limiter import Grant
from ..engine.requests import Attempts as _State  # a pack's attempts: a request's fields
from ..engine.requests import backoff_delay
from ..engine.runner import run_concurrently
from . import _constants as C
from .answers import EmbeddingAnswer, EmbeddingResult, decode, shares
from .packing import EmbedItem, PackLimits, packs

_FREE = Grant(0.0)
_SPLIT_STATUSES = (400, 413, 422)
# OpenAI's 400 for an input over the model's limit has no error code; its message says it
# ("maximum context length is 8192 tokens").
_CONTEXT_MESSAGE = "maximum context length"


class EmbeddingSender:
    """Packs rows and sends them through one open engine (`LLMResource.engine(...)`). It stands
    where the partition run (assets/pipeline.py) holds an engine: `map` takes the rows and gives
    their results; `breaker`, `aborted_reason` and `limiter_wait_s` are the engine's."""

    def __init__(
        self,
        engine: Engine,
        *,
        limits: PackLimits,
        dimensions: int | None,
        encoding_format: str,
    ) -> None:
        self.engine = engine
        self.s = engine.s
        self.model = engine.s.model
        self.limits = limits
        self.dims = dimensions
        # Awaited before each pack is sent: the writer's room (a pack's results are delivered
        # as they come, so packs go only while the writer keeps up: memory stays bounded).
        self.room: Callable[[], Awaitable[None]] | None = None
        self.body: dict[str, Any] = {"model": self.model, "encoding_format": encoding_format}
        if dimensions is not None:
            self.body["dimensions"] = dimensions

    @property
    def breaker(self) -> Breaker:
        return self.engine.breaker

    @property
    def budget(self) -> SpendCap | None:
        return self.engine.budget

    @property
    def aborted_reason(self) -> str | None:
        return self.engine.aborted_reason

    @property
    def limiter_wait_s(self) -> float:
        return self.engine.limiter_wait_s

    def map(
        self,
        items: AsyncIterable[EmbedItem],
        *,
        on_result: Callable[[EmbeddingResult], None] | None = None,
    ) -> AsyncIterator[list[EmbeddingResult]]:
        """One list of results per pack, in completion order; `on_result` gets each row's at
        once. As many packs in flight as the engine's concurrency and MAX_ROWS_IN_FLIGHT allow."""
        workers = min(
            self.s.max_concurrency, max(1, C.MAX_ROWS_IN_FLIGHT // self.limits.max_inputs)
        )
        each = None if on_result is None else (lambda rs: [on_result(r) for r in rs])
        return run_concurrently(
            self.run_pack, packs(items, self.limits, self.model), workers=workers, on_result=each
        )

    async def run_pack(self, pack: list[EmbedItem]) -> list[EmbeddingResult]:
        if self.room is not None:
            await self.room()
        out = [_failed(i, *i.error) for i in pack if i.error is not None]
        live = [i for i in pack if i.error is None]
        for _ in live:
            self.engine.breaker.row_started()  # the retry budget grows with rows, not packs
        return out + (await self._send(live) if live else [])

    async def _send(self, items: list[EmbedItem]) -> list[EmbeddingResult]:
        eng = self.engine
        margin = eng.estimate_margin or 0.0
        st = _State(estimate=math.ceil(sum(i.tokens for i in items) * (1 + margin)))
        deadline = time.monotonic() + eng.s.deadline_s if eng.s.deadline_s is not None else None
        signatures: set[str] = set()
        while True:
            if eng.breaker.reason:
                return self._stopped(items, st)
            sent = await self._attempt(items, st, deadline)
            if isinstance(sent, list):
                return sent
            answer, grant, started = sent
            if isinstance(answer, EmbeddingAnswer):
                eng.breaker.success()
                return self._results(items, answer, st, started)
            if len(items) > 1 and not answer.retryable and self._isolates(answer):
                mid = len(items) // 2
                return await self._send(items[:mid]) + await self._send(items[mid:])
            delay = await self._on_error(items, answer, grant, st, signatures)
            if isinstance(delay, list):
                return delay
            if deadline is not None and time.monotonic() + delay >= deadline:
                return self._deadline(items, st)
            await asyncio.sleep(delay)

    @staticmethod
    def _isolates(exc: E.ProviderError) -> bool:
        """A refusal one input may cause: split the pack to find it."""
        return exc.status in _SPLIT_STATUSES or exc.error_class in (
            E.CONTEXT_LENGTH,
            E.REQUEST_TOO_LARGE,
        )

    async def _attempt(self, items: list[EmbedItem], st: _State, deadline: float | None) -> Any:
        """Wait for a slot of the shared limit and send once: (answer or ProviderError, grant,
        start), or the rows' final results when the pack cannot be sent."""
        eng = self.engine
        async with held(eng.gate):
            slot = await self._slot(items, st, deadline)
            if isinstance(slot, list):
                return slot
            grant = slot
            t = eng.s.request_timeout_s
            timeout = eng.gate.timeout(t) if eng.gate else t
            if deadline is not None:
                timeout = max(0.001, min(timeout, deadline - time.monotonic()))
            # The spend caps (engine/budget.py) hold the pack's worst case while it is out.
            spend = await eng.budget.hold(st.estimate, 0, timeout) if eng.budget else None
            if isinstance(spend, Refused):
                if eng.pacer is not None:
                    await eng.pacer.give_back(grant)
                return self._failed(items, st, spend.error_class, spend.message)
            st.attempt += 1
            started = time.perf_counter()
            st.first_send = st.first_send or started
            mark = eng.pacer.sent(st.estimate, 0) if eng.pacer is not None else None
            body = {**self.body, "input": [i.text for i in items]}
            answer: EmbeddingAnswer | E.ProviderError
            try:
                payload, headers = await eng.transport.embed(body, timeout)
                answer = decode(payload, headers, len(items), self.dims)
            except E.ProviderError as exc:
                st.last = answer = exc
            if spend is not None:  # charged its hold: the pack's tokens (no answer budget)
                await eng.budget.settle(spend, answer)  # type: ignore[union-attr]
            if eng.gate is not None:
                eng.gate.observe(started, answer)
            if isinstance(answer, EmbeddingAnswer) and eng.pacer is not None and mark is not None:
                eng.pacer.answered(
                    grant,
                    estimate=st.estimate,
                    max_tokens=0,
                    resp=answer,  # type: ignore[arg-type]  (its usage and headers)
                    mark=mark,
                    refund_unused=False,
                )
            return answer, grant, started

    async def _slot(
        self, items: list[EmbedItem], st: _State, deadline: float | None
    ) -> Grant | list[EmbeddingResult]:
        """A slot to send on now, or the rows' final results."""
        eng = self.engine
        if eng.pacer is None:
            return _FREE
        ceiling = eng.limiter.max_request_tokens if eng.limiter is not None else None
        if ceiling and st.estimate > ceiling:
            return self._failed(
                items,
                st,
                E.REQUEST_TOO_LARGE,
                f"the pack is about {st.estimate} tokens, more "
                f"than the tokens/min limit of {ceiling} can ever admit; not sent",
            )
        before = time.monotonic()
        try:
            grant = await eng.pacer.slot(st.estimate, 0, deadline)
        except E.LimiterError as exc:
            return self._failed(items, st, exc.error_class, str(exc.description))
        st.waited += time.monotonic() - before
        if grant is None:
            return self._deadline(items, st)
        if eng.breaker.reason or (deadline is not None and time.monotonic() >= deadline):
            await eng.pacer.give_back(grant)
            return self._stopped(items, st) if eng.breaker.reason else self._deadline(items, st)
        return grant

    async def _on_error(
        self,
        items: list[EmbedItem],
        exc: E.ProviderError,
        grant: Grant,
        st: _State,
        signatures: set[str],
    ) -> float | list[EmbeddingResult]:
        """Count the error (as the chat path does): the delay before the next attempt, or the
        rows' failed results."""
        eng = self.engine
        rate_limited = exc.status == 429 and exc.error_class not in E.NOT_RATE_SIGNALS
        if rate_limited:
            st.n429 += 1
            if eng.pacer is not None:
                await eng.pacer.rejected(grant, exc)
        eng.breaker.error(exc, signatures)
        if not exc.retryable or st.attempt >= eng.s.max_attempts:
            context = exc.status == 400 and _CONTEXT_MESSAGE in exc.message.lower()
            return self._failed(
                items, st, E.CONTEXT_LENGTH if context else exc.error_class, exc.message
            )
        if not rate_limited and not eng.breaker.take_retry():
            return self._failed(
                items,
                st,
                E.RETRY_BUDGET,
                f"{exc.message} (not retried: the run's retry budget is spent)",
            )
        return backoff_delay(st.attempt, exc.retry_after_s, exact=exc.hint_exact)

    # -- results ---------------------------------------------------------------------------
    def _results(
        self, items: list[EmbedItem], answer: EmbeddingAnswer, st: _State, started: float
    ) -> list[EmbeddingResult]:
        ended = time.perf_counter()
        counts = [i.tokens for i in items]
        total = answer.usage.prompt_tokens if answer.usage is not None else sum(counts)
        return [
            EmbeddingResult(
                item.id,
                "ok",
                prompt_tokens=tokens,
                completion_tokens=0,
                latency_ms=(ended - started) * 1000,
                total_ms=(ended - (st.first_send or started)) * 1000,
                attempts=st.attempt,
                estimated_tokens=item.tokens,
                rate_limit_wait_s=st.waited,
                http_429=st.n429 if k == 0 else 0,  # the pack's 429s, counted once
                model=answer.model,
                tokens_estimated=answer.usage is None,
                embedding=vector,
                truncated=item.truncated,
            )
            for k, (item, vector, tokens) in enumerate(
                zip(items, answer.vectors, shares(total, counts), strict=True)
            )
        ]

    def _failed(
        self, items: list[EmbedItem], st: _State, error_class: str, message: str
    ) -> list[EmbeddingResult]:
        total = (time.perf_counter() - st.first_send) * 1000 if st.first_send else None
        return [
            _failed(
                item,
                error_class,
                message,
                attempts=st.attempt,
                total_ms=total,
                rate_limit_wait_s=st.waited,
                http_429=st.n429 if k == 0 else 0,
            )
            for k, item in enumerate(items)
        ]

    def _stopped(self, items: list[EmbedItem], st: _State) -> list[EmbeddingResult]:
        """As the chat path: a pack that had a real error keeps it; the others say why the run
        stopped."""
        why = f"the run stopped after {self.engine.breaker.reason}"
        if st.last is not None:
            return self._failed(
                items, st, st.last.error_class, f"{st.last.message} (not retried: {why})"
            )
        return self._failed(items, st, E.ABORTED, f"aborted: {why}")

    def _deadline(self, items: list[EmbedItem], st: _State) -> list[EmbeddingResult]:
        why = f" (last error: {st.last.message})" if st.last else ""
        return self._failed(
            items, st, E.DEADLINE_EXCEEDED, f"deadline passed before the request could be sent{why}"
        )


def _failed(item: EmbedItem, error_class: str, message: str, **kw: Any) -> EmbeddingResult:
    return EmbeddingResult(
        item.id,
        "failed",
        error_class=error_class,
        error_message=message,
        estimated_tokens=item.tokens or None,
        truncated=item.truncated,
        **kw,
    )
