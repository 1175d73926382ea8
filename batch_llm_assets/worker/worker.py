"""The worker loop: claim messages, run each through the engine, write llm-d results.

At most `concurrency` messages are held at once. A heartbeat keeps their visibility alive
while they are in flight, so a slow request is never taken over by another worker, while a
killed worker's messages expire and are reclaimed. On stop, in-flight requests get
`drain_timeout_s` to finish; whatever is left is handed back to the queue at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from ..engine import Engine, cancel_and_wait
from ..engine import errors as E
from . import messages as M
from .metrics import WorkerMetrics
from .queue import RedisQueue
from .settings import WorkerSettings

log = logging.getLogger(__name__)


def retry_delay(retry: int, remaining_s: float, initial_s: float, max_s: float) -> float:
    """Exponential backoff with jitter, always landing before the deadline (as llm-d)."""
    delay = min(initial_s * 2 ** (retry - 1), max_s) * (0.75 + 0.25 * random.random())
    return max(0.0, min(delay, remaining_s * 0.9))


class Worker:
    """One worker process's loop over one set of queues."""

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        engine: Engine,
        queue: RedisQueue,
        metrics: WorkerMetrics,
    ) -> None:
        self.s = settings
        self.engine = engine
        self.queue = queue
        self.metrics = metrics
        self.stopping = False
        self._held: dict[asyncio.Task, str] = {}  # task -> member it holds
        self._wake = asyncio.Event()
        metrics.pool_worker_limit.set(settings.concurrency)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then drain and return."""
        side = [
            asyncio.create_task(self._heartbeat()),
            asyncio.create_task(self._watch_backlog()),
        ]
        try:
            while not stop.is_set():
                free = self.s.concurrency - len(self._held)
                claimed = 0
                if free > 0:
                    try:
                        claim = await self.queue.claim(min(free, self.s.batch_size))
                    except (TimeoutError, OSError, ConnectionError) as exc:
                        log.warning("Queue Redis unreachable (%s); retrying.", exc)
                        claim = None
                    except Exception as exc:  # a Redis error reply: keep serving, say so
                        log.error("Claim failed: %s", exc)
                        claim = None
                    if claim is not None:
                        if claim.reclaimed:
                            self.metrics.reclaimed.inc(claim.reclaimed)
                            log.info("Reclaimed %d expired messages.", claim.reclaimed)
                        for member in claim.members:
                            task = asyncio.create_task(self._handle(member))
                            self._held[task] = member
                            task.add_done_callback(self._done)
                        claimed = len(claim.members)
                if claimed == 0 or free - claimed <= 0:
                    # Idle or full: wait for the poll interval, a free slot, or stop.
                    self._wake.clear()
                    waiters = [asyncio.ensure_future(stop.wait())]
                    if free - claimed <= 0:
                        waiters.append(asyncio.ensure_future(self._wake.wait()))
                    await asyncio.wait(
                        waiters, timeout=self.s.poll_interval_s, return_when="FIRST_COMPLETED"
                    )
                    for w in waiters:
                        w.cancel()
        finally:
            self.stopping = True
            await self._drain()
            await cancel_and_wait(side)  # a poller's lost cancel hung the stop (cancel.py)

    def _done(self, task: asyncio.Task) -> None:
        self._held.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            # The member stays in the processing set: it is reclaimed when its visibility ends.
            log.error("Message handling failed; it will be retried.", exc_info=task.exception())
        self._wake.set()

    async def _drain(self) -> None:
        """Let in-flight messages finish; hand back the rest at once (no visibility wait)."""
        tasks = list(self._held)
        if tasks:
            log.info(
                "Stopping: waiting up to %.0f s for %d messages.",
                self.s.drain_timeout_s,
                len(tasks),
            )
            await asyncio.wait(tasks, timeout=self.s.drain_timeout_s)
        left = {t: m for t, m in self._held.items() if not t.done()}
        await cancel_and_wait(left)
        if left:
            returned = await self.queue.release(list(left.values()))
            log.info("Handed %d unfinished messages back to the queue.", returned)

    async def _heartbeat(self) -> None:
        period = self.s.visibility_timeout_s / 3
        while True:
            await asyncio.sleep(period)
            try:
                await self.queue.extend(list(self._held.values()))
            except Exception as exc:  # the next beat tries again; expiry is the fallback
                log.warning("Could not extend visibility: %s", exc)

    async def _watch_backlog(self) -> None:
        while True:
            try:
                depth = await self.queue.backlog()
                self.metrics.backlog.set(depth["request"])
                self.metrics.retry_backlog.set(depth["retry"])
                self.metrics.processing.set(depth["processing"])
            except Exception as exc:
                log.debug("Backlog poll failed: %s", exc)
            await asyncio.sleep(max(1.0, self.s.poll_interval_s))

    async def _answer(self, member: str, key: str, result: str) -> None:
        if not await self.queue.ack(member, result, key):
            self.metrics.duplicates.inc()

    async def _handle(self, member: str) -> None:
        m = self.metrics
        m.queue_depth.inc()
        try:
            try:
                msg = M.parse_message(member)
                if msg.retry_count == 0:
                    m.requests.inc()
                request = msg.to_chat_request(self.s.model)
            except M.InvalidMessage as exc:
                m.invalid.inc()
                m.failed.inc()
                log.warning("Invalid message %r: %s", exc.id, exc)
                key = M.result_key(exc.id, member)
                await self._answer(member, key, M.error_result(exc.id, M.INVALID_REQUEST, str(exc)))
                return
            done, cancelled = await self.queue.state(msg.id)
            if done:
                m.duplicates.inc()
                await self.queue.drop(member)
                return
            if cancelled:
                m.cancelled.inc()
                await self._answer(member, msg.id, M.error_result(msg.id, M.CANCELLED, "cancelled"))
                return
            if time.time() >= msg.deadline:
                m.exceeded_deadline.inc()
                await self._answer(
                    member, msg.id, M.error_result(msg.id, M.DEADLINE_EXCEEDED, "deadline exceeded")
                )
                return
        finally:
            m.queue_depth.dec()
        m.inflight.inc()
        m.dispatched.inc()
        try:
            result = await self.engine.run_one(request)
        finally:
            m.inflight.dec()
        m.record_result(result)
        if M.answered(result):
            m.successful.inc()
            await self._answer(member, msg.id, M.ok_result(msg, result, self.s.model))
            return
        remaining = msg.deadline - time.time()
        if result.error_class in M.RETRYABLE_CLASSES and remaining > 0 and not self.stopping:
            delay = retry_delay(
                msg.retry_count + 1, remaining, self.s.retry_initial_s, self.s.retry_max_s
            )
            m.retries.inc()
            log.info("Retrying %r in %.1f s: %s", msg.id, delay, result.error_message)
            await self.queue.retry(member, msg.with_retry(), delay)
            return
        if result.error_class in M.RETRYABLE_CLASSES and remaining > 0:
            await self.queue.release([member])  # stopping: another worker takes it now
            return
        code = M.failed_code(result)
        if code == M.DEADLINE_EXCEEDED or result.error_class in M.RETRYABLE_CLASSES:
            code = M.DEADLINE_EXCEEDED
            m.exceeded_deadline.inc()
        else:
            m.failed.inc()
        text = result.error_message or result.error_class or "failed"
        await self._answer(
            member, msg.id, M.error_result(msg.id, code, E.redact(text, self.s.api_key))
        )
