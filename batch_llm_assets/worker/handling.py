"""One message's handling: intake, dispatch through its queue's engine, retry, dead-letter.

Every message ends with exactly one result, paid at most once: an id with a result is not sent
again, an id in flight is not sent twice (its lock), an answer is recorded before its result is
written (a failed write or a crash re-uses it), a delivery whose handling raised is tried
again at most `max_deliveries` times and then dead-lettered to its queue's dead-letter list, and
a breaker scope that is open holds its messages rather than failing them (breaker.py).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from dataclasses import dataclass, field

from ..engine import ChatRequest, ChatResult
from ..engine import errors as E
from . import _constants as K
from . import messages as M
from .breaker import ENDPOINT_CLASSES, Admission, ScopedBreaker, producer_scope
from .queue import Held
from .settings import Lane, WorkerSettings

log = logging.getLogger(__name__)


def retry_delay(retry: int, remaining_s: float, initial_s: float, max_s: float) -> float:
    """Exponential backoff with jitter, always landing before the deadline (as llm-d)."""
    # The exponent is capped: a producer's retry_count of 10**6 must not overflow the float.
    delay = min(initial_s * 2 ** min(retry - 1, 32), max_s) * (0.75 + 0.25 * random.random())
    return max(0.0, min(delay, remaining_s * 0.9))


@dataclass(slots=True)
class Job:
    """One delivery of one member: what is known of it so far."""

    held: Held
    deliveries: int
    lane: Lane  # the request queue it came from
    msg: M.RequestMessage | None = None
    key: str = ""  # the id as in Redis keys (or the member's digest when it has no id)
    scopes: tuple[str, str] = ("", "")  # its queue's endpoint, its producer (breaker.py)
    admission: Admission = field(default_factory=Admission)

    @property
    def member(self) -> bytes:
        return self.held.member


class Handling:
    """The per-message half of the worker (worker.py runs the loop that claims)."""

    s: WorkerSettings
    breaker: ScopedBreaker
    lanes: list[Lane]
    stopping: bool

    async def _handle(self, job: Job) -> None:
        try:
            request = await self._intake(job)
            if request is not None:
                await self._dispatch(job, request)
        except Exception as exc:
            await self._delivery_failed(job, exc)

    async def _answer(self, job: Job, result: str) -> None:
        if not await job.lane.queue.ack(job.held, result, job.key):
            job.lane.metrics.duplicates.inc()

    async def _settle(self, job: Job, result: str) -> None:
        """A result after a send: recorded first, so that it is never paid for twice."""
        await job.lane.queue.record(job.key, result)
        await self._answer(job, result)

    async def _intake(self, job: Job) -> ChatRequest | None:
        """The engine's request, or None when the message was answered, dropped or held."""
        m = job.lane.metrics
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
            job.scopes = (job.lane.scope, producer_scope(msg.producer))
            if msg.retry_count == 0 and job.deliveries == 1:
                m.requests.inc()
            return await self._begin(job, request)
        finally:
            m.queue_depth.dec()

    async def _begin(self, job: Job, request: ChatRequest) -> ChatRequest | None:
        """What Redis knows of the id, the deadline and the breaker, before anything is paid."""
        m, msg, queue = job.lane.metrics, job.msg, job.lane.queue
        assert msg is not None
        token = uuid.uuid4().hex
        begin = await queue.begin(job.key, M.storable(msg.id), token)
        if begin.state == "done":
            m.duplicates.inc()
            await queue.drop(job.member)
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
        job.held = Held(job.member, queue.names.inflight_key(job.key), token)
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
        engine = job.lane.engine
        if job.lane.scope in job.admission.probes and engine.aborted_reason:
            engine.breaker.reset()  # the probe goes through the engine's breaker too
        return request

    async def _hold(self, job: Job, wait_s: float, reason: str) -> None:
        """Back to the retry set for wait_s, or DEADLINE_EXCEEDED if it would expire there."""
        msg = job.msg
        assert msg is not None
        if time.time() + wait_s >= msg.deadline:
            job.lane.metrics.exceeded_deadline.inc()
            text = f"deadline exceeded, not sent: {reason}"
            await self._answer(job, M.error_result(msg.id, M.DEADLINE_EXCEEDED, text))
            return
        await job.lane.queue.retry(job.held, job.member, wait_s)

    async def _dispatch(self, job: Job, request: ChatRequest) -> None:
        m, msg, engine = job.lane.metrics, job.msg, job.lane.engine
        assert msg is not None
        m.inflight.inc()
        m.dispatched.inc()
        result: ChatResult | None = None
        try:
            result = await engine.run_one(request)
        finally:
            m.inflight.dec()
            self.breaker.record(job.scopes, job.admission, result)
            if result is not None and result.error_class == E.ABORTED:
                reason = engine.aborted_reason or "the engine stopped sending"
                self.breaker.open_endpoint(job.lane.scope, reason)
            for lane in self.lanes:
                lane.metrics.breaker_open.set(self.breaker.open_scopes())
        m.record_result(result)
        if M.answered(result):
            m.successful.inc()
            await self._settle(job, M.ok_result(msg, result, self.s.model))
            return
        remaining = msg.deadline - time.time()
        waits = result.error_class in M.RETRYABLE_CLASSES or result.error_class in ENDPOINT_CLASSES
        if waits and remaining > 0 and self.stopping:
            await job.lane.queue.release([job.held])  # another worker takes it now
            return
        if waits and remaining > 0:
            delay = retry_delay(
                msg.retry_count + 1, remaining, self.s.retry_initial_s, self.s.retry_max_s
            )
            m.retries.inc()
            log.info("Retrying %r in %.1f s: %s", msg.id, delay, result.error_message)
            await job.lane.queue.retry(job.held, msg.with_retry(), delay)
            return
        code = M.failed_code(result)
        if code == M.DEADLINE_EXCEEDED or waits:
            code = M.DEADLINE_EXCEEDED
            m.exceeded_deadline.inc()
        else:
            m.failed.inc()
        text = E.redact(result.error_message or result.error_class or "failed", self.s.api_key)
        await self._settle(job, M.error_result(msg.id, code, text))

    async def _delivery_failed(self, job: Job, exc: Exception) -> None:
        """Handling raised: deliver it again later (its count kept), or dead-letter it."""
        job.lane.metrics.failed_deliveries.inc()
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
            await job.lane.queue.retry(job.held, job.member, delay, cause)
        except Exception as again:
            log.error(
                "Could not record the failure of %r (%s); it returns when its visibility ends.",
                msg_id,
                again,
            )

    async def _dead_letter(self, job: Job, cause: str | None) -> None:
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
        recorded, answer = await job.lane.queue.last_failure(job.member, key)
        failed = self.s.max_deliveries
        if cause is None:
            cause = recorded or (
                f"its worker stopped {failed} times while handling it (killed, out of "
                "memory, or cut off from Redis)"
            )
        text = f"dead-lettered after {failed} failed deliveries: {cause}"
        result = M.error_result(msg_id, M.INFERENCE_ERROR, text)
        names = job.lane.queue.names
        entry = M.dead_letter_entry(
            msg_id=msg_id,
            member=job.member,
            cause=cause,
            deliveries=failed,
            queue=job.lane.spec.name,
            result=result,
            answer=answer,
        )
        kept, written = await job.lane.queue.dead_letter(job.held, result, key, entry)
        job.lane.metrics.dead_lettered.inc()
        log.error("Message %r dead-lettered to %s: %s", msg_id, names.dead_letter_list, cause)
        if not kept:
            log.error("The dead-letter list %s refused message %r.", names.dead_letter_list, msg_id)
        if written not in (0, 1):
            log.error("The error result of %r could not be written either: %r", msg_id, written)
