"""The worker loop: claim messages, run each through the engine, write llm-d results.

At most `concurrency` messages are held at once. A heartbeat keeps their visibility alive
while they are in flight, so a slow request is never taken over by another worker, while a
killed worker's messages expire and are reclaimed. On stop, in-flight requests get
`drain_timeout_s` to finish; whatever is left is handed back to the queue at once.

Every message ends with exactly one result, paid at most once: an id with a result is not sent
again, an id in flight is not sent twice (its lock), an answer is recorded before its result is
written (a failed write or a crash re-uses it), a delivery whose handling raised is tried
again at most `max_deliveries` times and then dead-lettered, and a breaker scope that is open
holds its messages rather than failing them (breaker.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass, field

from ..engine import ChatRequest, ChatResult, Engine, cancel_and_wait
from ..engine import errors as E
from . import _constants as K
from . import messages as M
from .breaker import ENDPOINT, ENDPOINT_CLASSES, Admission, ScopedBreaker, producer_scope
from .metrics import WorkerMetrics
from .queue import Held, RedisQueue
from .settings import WorkerSettings

log = logging.getLogger(__name__)


def retry_delay(retry: int, remaining_s: float, initial_s: float, max_s: float) -> float:
    """Exponential backoff with jitter, always landing before the deadline (as llm-d)."""
    # The exponent is capped: a producer's retry_count of 10**6 must not overflow the float.
    delay = min(initial_s * 2 ** min(retry - 1, 32), max_s) * (0.75 + 0.25 * random.random())
    return max(0.0, min(delay, remaining_s * 0.9))


@dataclass(slots=True)
class _Job:
    """One delivery of one member: what is known of it so far."""

    held: Held
    deliveries: int
    msg: M.RequestMessage | None = None
    key: str = ""  # the id as in Redis keys (or the member's digest when it has no id)
    scopes: tuple[str, str] = (ENDPOINT, producer_scope(""))
    admission: Admission = field(default_factory=Admission)

    @property
    def member(self) -> bytes:
        return self.held.member


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
        self.breaker = ScopedBreaker(cooldown_s=settings.breaker_cooldown_s)
        self.stopping = False
        self._held: dict[asyncio.Task, _Job] = {}  # task -> the delivery it handles
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
                claimed = await self._claim(free) if free > 0 else 0
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

    async def _claim(self, free: int) -> int:
        try:
            claim = await self.queue.claim(min(free, self.s.batch_size))
        except (TimeoutError, OSError, ConnectionError) as exc:
            log.warning("Queue Redis unreachable (%s); retrying.", exc)
            return 0
        except Exception as exc:  # a Redis error reply: keep serving, say so
            log.error("Claim failed: %s", exc)
            return 0
        if claim.reclaimed:
            self.metrics.reclaimed.inc(claim.reclaimed)
            log.info("Reclaimed %d expired messages.", claim.reclaimed)
        for member, deliveries in zip(claim.members, claim.deliveries, strict=True):
            job = _Job(Held(member), deliveries)
            task = asyncio.create_task(self._handle(job))
            self._held[task] = job
            task.add_done_callback(self._done)
        return len(claim.members)

    def _done(self, task: asyncio.Task) -> None:
        self._held.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            # Even the failure could not be recorded: the visibility expiry hands it back.
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
        left = {t: job.held for t, job in self._held.items() if not t.done()}
        await cancel_and_wait(left)
        if left:
            returned = await self.queue.release(list(left.values()))
            log.info("Handed %d unfinished messages back to the queue.", returned)

    async def _heartbeat(self) -> None:
        period = self.s.visibility_timeout_s / 3
        while True:
            await asyncio.sleep(period)
            try:
                await self.queue.extend([job.held for job in self._held.values()])
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

    async def _handle(self, job: _Job) -> None:
        try:
            request = await self._intake(job)
            if request is not None:
                await self._dispatch(job, request)
        except Exception as exc:
            await self._delivery_failed(job, exc)

    async def _answer(self, job: _Job, result: str) -> None:
        if not await self.queue.ack(job.held, result, job.key):
            self.metrics.duplicates.inc()

    async def _settle(self, job: _Job, result: str) -> None:
        """A result after a send: recorded first, so that it is never paid for twice."""
        await self.queue.record(job.key, result)
        await self._answer(job, result)

    async def _intake(self, job: _Job) -> ChatRequest | None:
        """The engine's request, or None when the message was answered, dropped or held."""
        m = self.metrics
        m.queue_depth.inc()
        try:
            if job.deliveries > self.s.max_deliveries:
                await self._dead_letter(job, None)
                return None
            try:
                msg = job.msg = M.parse_message(job.member)
                request = msg.to_chat_request(self.s.model)
            except M.InvalidMessage as exc:
                m.invalid.inc()
                m.failed.inc()
                log.warning("Invalid message %r: %s", exc.id, exc)
                job.key = M.result_key(exc.id, job.member)
                await self._answer(job, M.error_result(exc.id, M.INVALID_REQUEST, str(exc)))
                return None
            job.key = M.id_key(msg.id)
            job.scopes = (ENDPOINT, producer_scope(msg.producer))
            if msg.retry_count == 0 and job.deliveries == 1:
                m.requests.inc()
            return await self._begin(job, request)
        finally:
            m.queue_depth.dec()

    async def _begin(self, job: _Job, request: ChatRequest) -> ChatRequest | None:
        """What Redis knows of the id, the deadline and the breaker, before anything is paid."""
        m, msg = self.metrics, job.msg
        assert msg is not None
        token = uuid.uuid4().hex
        begin = await self.queue.begin(job.key, M.storable(msg.id), token)
        if begin.state == "done":
            m.duplicates.inc()
            await self.queue.drop(job.member)
            return None
        if begin.state == "cancelled":
            m.cancelled.inc()
            await self._answer(job, M.error_result(msg.id, M.CANCELLED, "cancelled"))
            return None
        if begin.state == "answer":  # answered before; its result was not written then
            await self._answer(job, begin.answer or "")
            return None
        if begin.state == "busy":
            m.duplicates.inc()
            await self._hold(job, K.RECHECK_S, "a message with this id is in flight")
            return None
        job.held = Held(job.member, self.queue.names.inflight_key(job.key), token)
        if time.time() >= msg.deadline:
            m.exceeded_deadline.inc()
            await self._answer(
                job, M.error_result(msg.id, M.DEADLINE_EXCEEDED, "deadline exceeded")
            )
            return None
        job.admission = self.breaker.admit(job.scopes)
        if job.admission.wait_s > 0:
            m.breaker_held.inc()
            await self._hold(job, job.admission.wait_s, job.admission.reason)
            return None
        if ENDPOINT in job.admission.probes and self.engine.aborted_reason:
            self.engine.breaker.reset()  # the probe goes through the engine's breaker too
        return request

    async def _hold(self, job: _Job, wait_s: float, reason: str) -> None:
        """Back to the retry set for wait_s, or DEADLINE_EXCEEDED if it would expire there."""
        msg = job.msg
        assert msg is not None
        if time.time() + wait_s >= msg.deadline:
            self.metrics.exceeded_deadline.inc()
            text = f"deadline exceeded, not sent: {reason}"
            await self._answer(job, M.error_result(msg.id, M.DEADLINE_EXCEEDED, text))
            return
        await self.queue.retry(job.held, job.member, wait_s)

    async def _dispatch(self, job: _Job, request: ChatRequest) -> None:
        m, msg = self.metrics, job.msg
        assert msg is not None
        m.inflight.inc()
        m.dispatched.inc()
        result: ChatResult | None = None
        try:
            result = await self.engine.run_one(request)
        finally:
            m.inflight.dec()
            self.breaker.record(job.scopes, job.admission, result)
            if result is not None and result.error_class == E.ABORTED:
                reason = self.engine.aborted_reason or "the engine stopped sending"
                self.breaker.open_endpoint(reason)
            m.breaker_open.set(self.breaker.open_scopes())
        m.record_result(result)
        if M.answered(result):
            m.successful.inc()
            await self._settle(job, M.ok_result(msg, result, self.s.model))
            return
        remaining = msg.deadline - time.time()
        waits = result.error_class in M.RETRYABLE_CLASSES or result.error_class in ENDPOINT_CLASSES
        if waits and remaining > 0 and self.stopping:
            await self.queue.release([job.held])  # another worker takes it now
            return
        if waits and remaining > 0:
            delay = retry_delay(
                msg.retry_count + 1, remaining, self.s.retry_initial_s, self.s.retry_max_s
            )
            m.retries.inc()
            log.info("Retrying %r in %.1f s: %s", msg.id, delay, result.error_message)
            await self.queue.retry(job.held, msg.with_retry(), delay)
            return
        code = M.failed_code(result)
        if code == M.DEADLINE_EXCEEDED or waits:
            code = M.DEADLINE_EXCEEDED
            m.exceeded_deadline.inc()
        else:
            m.failed.inc()
        text = E.redact(result.error_message or result.error_class or "failed", self.s.api_key)
        await self._settle(job, M.error_result(msg.id, code, text))

    async def _delivery_failed(self, job: _Job, exc: Exception) -> None:
        """Handling raised: deliver it again later (its count kept), or dead-letter it."""
        self.metrics.failed_deliveries.inc()
        cause = E.redact(f"{type(exc).__name__}: {exc}", self.s.api_key)[:1000]
        msg_id = job.msg.id if job.msg else ""
        log.error(
            "Handling message %r failed (delivery %d of %d): %s",
            msg_id,
            job.deliveries,
            self.s.max_deliveries,
            cause,
        )
        try:
            if job.deliveries >= self.s.max_deliveries:
                await self._dead_letter(job, cause)
                return
            remaining = job.msg.deadline - time.time() if job.msg else self.s.retry_max_s
            delay = retry_delay(
                job.deliveries, remaining, self.s.retry_initial_s, self.s.retry_max_s
            )
            await self.queue.retry(job.held, job.member, delay, cause)
        except Exception as again:
            log.error(
                "Could not record the failure of %r (%s); it returns when its visibility ends.",
                msg_id,
                again,
            )

    async def _dead_letter(self, job: _Job, cause: str | None) -> None:
        """Answer it with an error naming the cause; keep it, and any answer, in the dead
        letters. cause None: the workers that held it before stopped (claimed once too often)."""
        if job.msg is None:
            try:
                job.msg = M.parse_message(job.member)
            except M.InvalidMessage as exc:
                msg_id = exc.id
        if job.msg is not None:
            msg_id = job.msg.id
        key = job.key or M.result_key(msg_id, job.member)
        recorded, answer = await self.queue.last_failure(job.member, key)
        failed = self.s.max_deliveries
        if cause is None:
            cause = recorded or (
                f"its worker stopped {failed} times while handling it (killed, out of "
                "memory, or cut off from Redis)"
            )
        text = f"dead-lettered after {failed} failed deliveries: {cause}"
        result = M.error_result(msg_id, M.INFERENCE_ERROR, text)
        names = self.queue.names
        entry = M.dead_letter_entry(
            msg_id=msg_id,
            member=job.member,
            cause=cause,
            deliveries=failed,
            queue=names.request_sortedset,
            result=result,
            answer=answer,
        )
        kept, written = await self.queue.dead_letter(job.held, result, key, entry)
        self.metrics.dead_lettered.inc()
        log.error("Message %r dead-lettered to %s: %s", msg_id, names.dead_letter_list, cause)
        if not kept:
            log.error("The dead-letter list %s refused message %r.", names.dead_letter_list, msg_id)
        if written not in (0, 1):
            log.error("The error result of %r could not be written either: %r", msg_id, written)
