"""Many requests through one async function with a bounded number of workers, results in
completion order, cancel-safe (the engine's `map`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")


async def run_concurrently(
    run_one: Callable[[In], Awaitable[Out]],
    items: Iterable[In] | AsyncIterable[In],
    *,
    workers: int,
    on_result: Callable[[Out], None] | None = None,
) -> AsyncIterator[Out]:
    """Yield `run_one(item)` for every item as each completes, `workers` at a time. Input is
    pulled lazily; results wait in a queue of `workers` places (a busy consumer holds the
    workers back). An exception in a worker (the source, `on_result`, a bug) stops it all and is
    raised here; closing or cancelling the consumer cancels the workers at once."""
    pool = _Pool(_aiter(items), max(1, workers))
    tasks = [asyncio.create_task(pool.work(run_one, on_result)) for _ in range(pool.n)]
    try:
        finished = 0
        while finished < pool.n:
            got = await pool.out.get()
            if got is _DONE:
                finished += 1
            elif isinstance(got, _Failed):
                raise got.exc
            else:
                yield got
    finally:
        await pool.shut_down(tasks)


class _Pool:
    """What the workers of one run share: the input (pulled under a lock), the results queue
    and the stop flag."""

    def __init__(self, source: AsyncIterator[Any], n: int) -> None:
        self.source, self.n = source, n
        self.out: asyncio.Queue[Any] = asyncio.Queue(maxsize=n)
        self.lock = asyncio.Lock()
        self.stop = asyncio.Event()

    async def work(
        self, run_one: Callable[[Any], Awaitable[Any]], on_result: Callable[[Any], None] | None
    ) -> None:
        """One worker: take the next item, run it, queue its result, until the input ends."""
        me = asyncio.current_task()
        assert me is not None
        try:
            while not self.stop.is_set():
                async with self.lock:
                    if self.stop.is_set():
                        break
                    try:
                        item = await anext(self.source)
                    except StopAsyncIteration:
                        break
                result = await run_one(item)
                if on_result is not None:
                    on_result(result)
                if self.stop.is_set() or me.cancelling():  # the consumer is gone; a library
                    return  # below may have swallowed the cancel: do not wait on the queue
                await self.out.put(result)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the source, the hook, or a bug: stop sending, report
            self.stop.set()
            await self.out.put(_Failed(exc))
            return
        if not me.cancelling():
            await self.out.put(_DONE)

    async def shut_down(self, tasks: list[asyncio.Task[None]]) -> None:
        """Stop and cancel every worker (waking any blocked on the full queue), then close the
        input."""
        self.stop.set()
        pending = set(tasks)
        while pending:
            for t in pending:
                t.cancel()
            while not self.out.empty():
                self.out.get_nowait()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        await _close(self.source)


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_DONE = object()


async def _aiter(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
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


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects alive before the run (Dagster's, the modules': about 300,000) are left out
    of the garbage collector's full passes while the run allocates: each such pass otherwise
    walks them all, a 0.2 s stall of the event loop (measured: 3 passes, 0.63 s, in a
    100,000-row run; 5 ms with the heap frozen). They are handed back afterwards."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
