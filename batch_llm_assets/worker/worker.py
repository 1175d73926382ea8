"""The worker loop: claim messages from its request queues by the merge policy, hand each to
its handling (handling.py), write llm-d results.

At most `concurrency` messages are held at once, across the queues. A heartbeat keeps their
visibility alive while they are in flight, so a slow request is never taken over by another
worker, while a killed worker's messages expire and are reclaimed. On stop, in-flight requests
get `drain_timeout_s` to finish; whatever is left is handed back to its queue at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from ..engine import cancel_and_wait
from . import messages as M
from .breaker import ScopedBreaker, producer_scope
from .handling import Handling, Job
from .merge import POLICIES
from .queue import Held
from .settings import Lane, WorkerParts, WorkerSettings

log = logging.getLogger(__name__)


class Worker(Handling):
    """One worker process's loop over its request queues."""

    def __init__(self, settings: WorkerSettings, parts: WorkerParts) -> None:
        self.s = settings
        self.lanes = parts.lanes
        self.metrics = parts.metrics
        self.policy = POLICIES[settings.merge_policy]()
        self.breaker = ScopedBreaker(cooldown_s=settings.breaker_cooldown_s)
        self.stopping = False
        self._held: dict[asyncio.Task, Job] = {}  # task -> the delivery it handles
        self._wake = asyncio.Event()
        parts.metrics.pool_worker_limit.set(settings.concurrency)

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
        """Up to a batch, from the queues the merge policy picks; what an empty queue could not
        give is picked again among the others."""
        wanted, taken, ready = min(free, self.s.batch_size), 0, list(self.lanes)
        while taken < wanted and ready:
            asked = wanted - taken
            try:
                picks = await self.policy.pick(asked, ready)
            except Exception as exc:  # deadline-first reads the queues' heads
                log.warning("Merge policy could not read the queues (%s); retrying.", exc)
                return taken
            for lane, n in Counter(picks).items():
                got = await self._claim_from(lane, n)
                taken += got
                if got < n:
                    ready.remove(lane)
            if len(picks) < asked:
                break  # the queues hold no more
        return taken

    async def _claim_from(self, lane: Lane, n: int) -> int:
        try:
            claim = await lane.queue.claim(n)
        except (TimeoutError, OSError, ConnectionError) as exc:
            log.warning("Queue Redis unreachable (%s); retrying.", exc)
            return 0
        except Exception as exc:  # a Redis error reply: keep serving, say so
            log.error("Claim from %s failed: %s", lane.spec.name, exc)
            return 0
        if claim.reclaimed:
            lane.metrics.reclaimed.inc(claim.reclaimed)
            log.info("Reclaimed %d expired messages of %s.", claim.reclaimed, lane.spec.name)
        for member, deliveries in zip(claim.members, claim.deliveries, strict=True):
            job = Job(Held(member), deliveries, lane, scopes=(lane.scope, producer_scope("")))
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
        left = {t: job for t, job in self._held.items() if not t.done()}
        await cancel_and_wait(left)
        for lane in self.lanes:
            held = [job.held for job in left.values() if job.lane is lane]
            if held:
                returned = await lane.queue.release(held)
                log.info("Handed %d unfinished messages back to %s.", returned, lane.spec.name)

    async def _heartbeat(self) -> None:
        period = self.s.visibility_timeout_s / 3
        while True:
            await asyncio.sleep(period)
            jobs = list(self._held.values())
            for lane in self.lanes:
                try:
                    await lane.queue.extend([job.held for job in jobs if job.lane is lane])
                except Exception as exc:  # the next beat tries again; expiry is the fallback
                    log.warning("Could not extend visibility: %s", exc)

    async def _watch_backlog(self) -> None:
        while True:
            for lane in self.lanes:
                try:
                    depth = await lane.queue.backlog()
                except Exception as exc:
                    log.debug("Backlog poll of %s failed: %s", lane.spec.name, exc)
                    continue
                m = lane.metrics
                m.backlog.set(depth["request"])
                m.retry_backlog.set(depth["retry"])
                m.processing.set(depth["processing"])
                created = [c for c in map(M.created_of, depth["next"]) if c is not None]
                m.oldest_age.set(max(0.0, time.time() - min(created)) if created else 0.0)
            await asyncio.sleep(max(1.0, self.s.poll_interval_s))
