"""One engine's side of the shared limit: wait for a slot, send on it, report the answer.

A request acquires a slot and sleeps until it once. It takes a fresh slot instead (giving the
old one back in the same call) when it woke later than its burst after the slot (an event-loop
stall: sending on it would bunch with the sends after it), or when its slot went stale while it
slept: an overload event (a 429, here or in another process) dropped the schedule it was
granted from, or the provider's bucket widened the burst so it may go sooner.
"""

from __future__ import annotations

import asyncio
import logging
import time

from . import _constants as C
from . import errors as E
from .controller import Controller, Mark
from .limiter import Grant, RedisLimiter, passes
from .transport import ChatResponse
from .usage import parse_limits

log = logging.getLogger(__name__)

_DUE, _STALE = 0, 1


class Pacer:
    def __init__(self, limiter: RedisLimiter) -> None:
        self.limiter = limiter
        self.controller = Controller(limiter)
        self._sleepers: set[asyncio.Future[int]] = set()
        self._epoch = 0  # the newest epoch this engine has seen
        self._feedback: set[asyncio.Task[None]] = set()
        limiter.on_reply = self._after_reply
        self._waiters = 0
        self._wait_since = 0.0
        self._wait_total = 0.0

    # -- waiting -----------------------------------------------------------------------------
    @property
    def wait_s(self) -> float:
        """Wall time during which at least one request waited for the limiter."""
        ongoing = time.monotonic() - self._wait_since if self._waiters else 0.0
        return self._wait_total + ongoing

    async def slot(self, estimate: int, max_tokens: int, deadline: float | None) -> Grant | None:
        """A slot to send on now, or None if the deadline would pass first. Each slot, a fresh
        one too or one granted after a wait in the limiter's line, reserves the request at the
        calibration learnt by then (`Grant.tokens`): the slots a restart sends at once, and a
        slow provider's line, were first asked for before the first answer taught it."""
        if self._waiters == 0:
            self._wait_since = time.monotonic()
        self._waiters += 1
        try:
            return await self._slot(estimate, max_tokens, deadline)
        finally:
            self._waiters -= 1
            if self._waiters == 0:
                self._wait_total += time.monotonic() - self._wait_since

    async def _slot(self, estimate: int, max_tokens: int, deadline: float | None) -> Grant | None:
        grant = await self._acquire(estimate, max_tokens, deadline, None)
        fresh = 0
        while True:  # sleep to the slot, or take a fresh one
            if not grant.granted or passes(deadline, grant.wait_s):
                await self.limiter.give_back(grant)
                return None
            due = time.monotonic() + grant.wait_s
            wakeable = fresh < C.MAX_FRESH_SLOTS  # out of fresh slots: it sleeps to its slot
            how = await self._sleep(grant.wait_s, wakeable) if grant.wait_s > 0 else _DUE
            late = time.monotonic() - due > self._tolerance(grant)
            if not ((late or how == _STALE) and wakeable):
                break
            fresh += 1
            grant = await self._acquire(estimate, max_tokens, deadline, grant)
        return grant

    def _tolerance(self, grant: Grant) -> float:
        """How late a wake may be and still send on its slot: its burst, and at least a send's
        jitter (with no burst, every wake is a few microseconds late)."""
        return max(grant.burst_s, self.limiter.settings.burst_s, C.LEARNED_BURST_MARGIN_S)

    async def _acquire(
        self, estimate: int, max_tokens: int, deadline: float | None, old: Grant | None
    ) -> Grant:
        def reserve() -> int:  # asked again by a request that waits in the limiter's line
            return self.controller.reservation(estimate, max_tokens)

        return await self.limiter.acquire(reserve, deadline=deadline, give_back=old)

    async def _sleep(self, wait_s: float, wakeable: bool) -> int:
        """Sleep until the slot; _STALE if woken before it to take a fresh one."""
        if not wakeable:
            await asyncio.sleep(wait_s)
            return _DUE
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[int] = loop.create_future()
        timer = loop.call_later(wait_s, _resolve, woken, _DUE)
        self._sleepers.add(woken)
        try:
            return await woken
        finally:
            timer.cancel()
            self._sleepers.discard(woken)

    def _after_reply(self) -> None:
        """On every reply of the limiter: wake the sleepers when their slots went stale, at a
        new epoch (limiter.lua starts one at a 429 and at a burst that widened). Every reply,
        not only a grant's: a request waiting in line hears of another process's 429 first, and
        the sleepers must not send on the old schedule meanwhile."""
        if self.limiter.epoch > self._epoch:
            self._epoch = self.limiter.epoch
            for woken in list(self._sleepers):
                _resolve(woken, _STALE)

    # -- answers -----------------------------------------------------------------------------
    def sent(self, estimate: int, max_tokens: int) -> Mark:
        return self.controller.on_send(estimate - max_tokens, max_tokens)

    def answered(
        self,
        grant: Grant,
        *,
        estimate: int,
        max_tokens: int,
        resp: ChatResponse,
        mark: Mark,
        refund_unused: bool,
    ) -> None:
        """Feed an answer back beside the row, not before it: the answer goes to the caller at
        once, never after a wait on Redis (`drain` awaits what is left)."""
        usage = resp.usage
        delta = 0
        if usage is not None:
            self.controller.calibrate(estimate, max_tokens, usage.prompt_tokens)
            answer = usage.completion_tokens if refund_unused else max_tokens
            delta = usage.prompt_tokens + answer - grant.tokens
        limits = parse_limits(resp.headers)
        view = self.controller.observe(limits, mark) if not limits.empty else None
        task = asyncio.ensure_future(self._settle(grant, delta, view))
        self._feedback.add(task)
        task.add_done_callback(self._feedback.discard)

    async def _settle(self, grant: Grant, delta: int, view: dict[str, float] | None) -> None:
        try:
            await self.limiter.settle(grant, tokens=delta, view=view, ok=True)
        except E.LimiterError as exc:
            self.limiter.warn("settle", "Could not report an answer to the limiter: %s", exc)

    async def rejected(self, grant: Grant, exc: E.ProviderError) -> None:
        """A 429 about the rate (not quota, not size): slow everyone down, pause everyone for
        the exact hint (a whole-second one is only an upper bound: the row's backoff)."""
        hint = exc.retry_after_s if exc.hint_exact else None
        try:
            await self.limiter.penalize(grant, retry_after_s=hint)
        except E.LimiterError:
            pass  # the retry's acquire reports it

    async def give_back(self, grant: Grant) -> None:
        await self.limiter.give_back(grant)

    async def drain(self, timeout_s: float) -> None:
        if self._feedback:
            await asyncio.wait(set(self._feedback), timeout=timeout_s)


def _resolve(future: asyncio.Future[int], value: int) -> None:
    if not future.done():
        future.set_result(value)
