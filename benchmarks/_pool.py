"""Client processes for the randomized suite, started once and reused from provider to provider.

Each worker runs one job at a time: it opens an engine through LLMResource (its own job_key,
the configured rpm/tpm), says it is ready, waits for the common start, sends its prompts, and
reports what it got and the limits its engine believes at the end. A job that outlives its
deadline is stopped there (its unanswered rows count as failed). Starting a process costs
2-3 s of imports on the 2-core VM; forty providers would spend minutes on them otherwise.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import time
from typing import Any

from _common import messages

from batch_llm_assets import ChatRequest, LLMResource


async def _job(job: dict[str, Any], outbox, go) -> dict[str, Any]:
    llm = LLMResource(**job["resource"])
    ok = n429 = 0
    timed_out = False
    async with llm.engine() as engine:
        outbox.put(("ready", job["worker"], None))
        await asyncio.to_thread(go.wait)  # all workers start together
        start = time.time()
        reqs = (ChatRequest(i, messages(p)) for i, p in job["prompts"])
        try:
            async with asyncio.timeout(job["deadline_s"]):
                async for r in engine.map(reqs):
                    ok += r.ok
                    n429 += r.http_429
        except TimeoutError:  # the rows not answered by then count as failed
            timed_out = True
        end = time.time()
        limiter = engine.limiter
        believed = (limiter.rpm, limiter.tpm) if limiter is not None else (None, None)
    return {
        "ok": ok,
        "failed": len(job["prompts"]) - ok,
        "http_429": n429,
        "start": start,
        "end": end,
        "timed_out": timed_out,
        "believed_rpm": believed[0],
        "believed_tpm": believed[1],
    }


def serve(inbox, outbox, go) -> None:
    while (job := inbox.get()) is not None:
        try:
            outbox.put(("result", job["worker"], asyncio.run(_job(job, outbox, go))))
        except Exception as exc:  # the main process reports it instead of waiting forever
            outbox.put(("error", job["worker"], repr(exc)))


class WorkerPool:
    """`size` spawned workers; `run(jobs, before_go, timeout_s)` runs one job on each of the first
    len(jobs) workers, started together."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ctx = mp.get_context("spawn")
        self._start()

    def _start(self) -> None:
        ctx = self._ctx
        self.outbox = ctx.Queue()
        self.go = ctx.Event()
        self.inboxes = [ctx.Queue() for _ in range(self.size)]
        self.procs = [
            ctx.Process(target=serve, args=(box, self.outbox, self.go), daemon=True)
            for box in self.inboxes
        ]
        for p in self.procs:
            p.start()

    def _collect(self, kind: str, n: int, deadline: float) -> dict[int, Any]:
        got: dict[int, Any] = {}
        while len(got) < n:
            try:
                what, worker, value = self.outbox.get(timeout=max(0.01, deadline - time.time()))
            except queue.Empty:
                raise TimeoutError(f"{n - len(got)} of {n} workers did not report {kind}") from None
            if what == "error":
                raise RuntimeError(f"worker {worker}: {value}")
            if what == kind:
                got[worker] = value
        return got

    def run(self, jobs: list[dict[str, Any]], *, before_go, deadline_s: float) -> list[dict]:
        """Results in job order; each job stops at deadline_s. A worker that does not report
        within a minute of that, or fails, restarts the pool and raises, so one bad provider
        does not hang or poison the next."""
        self.go.clear()
        try:
            for i, job in enumerate(jobs):
                self.inboxes[i].put({**job, "worker": i, "deadline_s": deadline_s})
            self._collect("ready", len(jobs), time.time() + 60)
            before_go()
            self.go.set()
            results = self._collect("result", len(jobs), time.time() + deadline_s + 60)
        except (TimeoutError, RuntimeError):
            self.restart()
            raise
        finally:
            self.go.clear()
        return [results[i] for i in range(len(jobs))]

    def restart(self) -> None:
        self.stop(graceful=False)
        self._start()

    def stop(self, *, graceful: bool = True) -> None:
        if graceful:
            for box in self.inboxes:
                box.put(None)
        for p in self.procs:
            p.join(timeout=10 if graceful else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
