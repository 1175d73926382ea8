"""Stopping tasks for certain: a cancel that something below swallowed is sent again.

On Python 3.11 `asyncio.wait_for` returns the inner result when a cancel arrives in the same
turn of the loop as that result, and the cancel is lost (CPython gh-86296; 3.12's rewrite
fixed it). redis-py wraps every send in `wait_for` when `socket_timeout` is set, so about one
cancel in four that met a task inside a Redis call was lost (a loop of GETs against a local
Redis, redis-py 8.1): a worker's backlog poller then ran on, and `Worker.run` waited on it
for ever after its stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

RECANCEL_S = 0.1  # a lost cancel is lost at once; a task still running this long got none


async def cancel_and_wait(
    tasks: Iterable[asyncio.Future[Any]], *, every_s: float = RECANCEL_S
) -> None:
    """Cancel `tasks` and return once every one has ended, cancelling again any that is still
    running after `every_s`. Their results and exceptions are left to the caller."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=every_s)
