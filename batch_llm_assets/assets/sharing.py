"""Identical requests sent once: a partition run's rows that make the same request share one answer.

A row's request identity is its `request_hash` (the exact body sent + the endpoint's scope,
engine/identity.py). The first row of an identity in a run is its leader and is sent; a row of
the same identity (a follower) that comes while the leader is in flight waits for its answer; one
that comes later takes the answer at once, from `recent` answers or from the output table. A
follower gets its own output row: the leader's answer (response, status, error, typed columns),
`cost_usd` 0, no tokens (it was not sent) and `shared_from` naming the row it took the answer
from. A leader that failed fails its followers the same way (marked shared): a rerun retries the
identity once, never once per row.

The output table is asked once per chunk (`lookup`): for answers stored `ok` under the chunk's
identities in this partition, or in any partition of the table when answers are reused across
partitions (`reuse`). So a rerun after a crash pays no identity twice, and a partition that
repeats another's requests pays only for the new ones.

Memory stays bounded: `recent` keeps up to RECENT_ANSWERS answers (the least recently used
leaves first) and an answer leaves only once it is in the warehouse and no chunk whose lookup
left it out (because it was here) is still being processed; at most MAX_WAITING followers wait
for leaders in flight before the reader pauses. The lookup of the next chunk runs while the
current one is sent (a BigQuery query takes seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from ..engine.engine import ChatRequest
from ..warehouses.base import OutputTable, WarehouseSession
from .writer import storable

if TYPE_CHECKING:
    from .metadata import RunStats
    from .writer import ChunkWriter

RECENT_ANSWERS = 10_000  # answers kept in memory for the followers still to come
MAX_WAITING = 10_000  # followers waiting for leaders in flight before the reader pauses

Lookup = Callable[[list[str]], Awaitable[dict[str, dict[str, Any]]]]


class _Answer:
    __slots__ = ("chunk", "row", "seq")

    def __init__(self, row: dict[str, Any], seq: int, chunk: int) -> None:
        self.row = row  # the leader's (or the stored) output row
        self.seq = seq  # its place in the writer's order (-1: already in the warehouse)
        self.chunk = chunk  # the last chunk whose lookup left this identity out


def reuses_answers(setting: bool | None, params: dict[str, Any]) -> bool:
    """`reuse_answers` as set, else on when the request's temperature is 0: a model then
    answers the same request the same way, so a stored answer is the answer."""
    if setting is not None:
        return setting
    t = params.get("temperature")
    return type(t) in (int, float) and t == 0


def stored_answers(
    db: WarehouseSession, output: OutputTable, partition_key: str, everywhere: bool
) -> Lookup:
    """The lookup of answers stored in `output` (this partition's, or any partition's when
    `everywhere`), in a thread: on DuckDB too, where on the event loop it would stall the
    answers whenever a write holds the connection (docs/benchmarks.md, dedupe.py)."""

    async def lookup(hashes: list[str]) -> dict[str, dict[str, Any]]:
        find = functools.partial(
            db.stored_answers, output, hashes, partition_key, everywhere=everywhere
        )
        return await asyncio.to_thread(find)

    return lookup


def _drop(found: asyncio.Future[Any]) -> None:
    """A lookup nobody will read: cancelled, or, when it already failed, its error marked read
    (the run is stopping anyway), so asyncio does not log it as never retrieved."""
    if not found.done():
        found.cancel()
    elif not found.cancelled():
        found.exception()


def id_text(value: Any) -> str:
    """An id as `shared_from` text: str(), bytes as hex."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    return storable(str(value))


class Sharing:
    """The requests of a partition run with identical ones sent once (see the module)."""

    def __init__(
        self,
        *,
        partition_key: str,
        hashes: dict[Any, str],
        writer: ChunkWriter,
        deliver: Callable[[list[dict[str, Any]]], None],
        lookup: Lookup,
        stats: RunStats,
        stored_may_match: bool,
    ) -> None:
        """`hashes`: id -> identity of the rows to send (the reader's; a follower's is taken
        here). `deliver`: rows to the writer and the journal, as answers go. `lookup`: the
        stored answers of a list of identities. `stored_may_match`: the table may hold answers
        for this run (reuse across partitions, or the partition has rows already)."""
        self.partition_key = partition_key
        self.hashes = hashes
        self.writer = writer
        self.deliver = deliver
        self.lookup = lookup
        self.stats = stats
        self.stored_may_match = stored_may_match
        self.waiting: dict[str, list[Any]] = {}  # identity in flight -> followers' ids
        self.recent: OrderedDict[str, _Answer] = OrderedDict()
        self.n_waiting = 0
        self._drained = asyncio.Event()
        self._started = 0  # chunks whose lookup has started
        self._processing = 0  # the chunk whose rows are being handed out
        self._evicted = False  # an answer of this run left `recent`: later rows need lookups

    # -- the requests --------------------------------------------------------------------------
    async def requests(
        self, chunks: AsyncGenerator[list[ChatRequest], None]
    ) -> AsyncIterator[ChatRequest]:
        """The leaders of each chunk, in order; followers become rows here or when their leader
        answers. A chunk's lookup starts before the previous chunk is handed out."""
        ahead: tuple[list[ChatRequest], asyncio.Future[Any]] | None = None
        started: tuple[list[ChatRequest], asyncio.Future[Any]] | None = None
        try:
            async with contextlib.aclosing(chunks):
                while True:
                    try:
                        chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                    except Exception:  # the reader failed: the rows read so far still go out
                        if ahead is not None:
                            async for req in self._hand_out(*ahead):
                                yield req
                            ahead = None
                        raise
                    started = (chunk, self._start_lookup(chunk))
                    if ahead is not None:
                        async for req in self._hand_out(*ahead):
                            yield req
                    ahead, started = started, None
            if ahead is not None:
                async for req in self._hand_out(*ahead):
                    yield req
                ahead = None
        finally:  # stopped early: the lookups not handed out are nobody's
            for pending in (ahead, started):
                if pending is not None:
                    _drop(pending[1])

    def _start_lookup(self, chunk: list[ChatRequest]) -> asyncio.Future[Any]:
        self._started += 1
        wanted: list[str] = []
        for req in chunk:
            h = self.hashes.get(req.id) if req.error is None else None
            if h is None or h in self.waiting:
                continue
            answer = self.recent.get(h)
            if answer is not None:
                answer.chunk = self._started  # kept until this chunk is handed out
            else:
                wanted.append(h)
        if not wanted or not (self.stored_may_match or self._evicted):
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            done.set_result({})
            return done
        return asyncio.ensure_future(self.lookup(list(dict.fromkeys(wanted))))

    async def _hand_out(
        self, chunk: list[ChatRequest], found: asyncio.Future[Any]
    ) -> AsyncIterator[ChatRequest]:
        stored: dict[str, dict[str, Any]] = await found
        self._processing += 1
        for h, row in stored.items():
            if h not in self.recent:
                self.recent[h] = _Answer(row, -1, self._processing)
        ready: list[dict[str, Any]] = []
        for req in chunk:
            h = self.hashes.get(req.id) if req.error is None else None
            if h is None:
                yield req
                continue
            followers = self.waiting.get(h)
            if followers is not None:
                del self.hashes[req.id]
                followers.append(req.id)
                self.n_waiting += 1
                if self.n_waiting >= MAX_WAITING:
                    await self._flush(ready)
                    await self._until_drained()
                continue
            answer = self.recent.get(h)
            if answer is not None:
                del self.hashes[req.id]
                self.recent.move_to_end(h)
                now = datetime.now(UTC)
                ready.append(self._follower(answer.row, req.id, now, reused=answer.seq < 0))
                continue
            self.waiting[h] = []
            await self._flush(ready)
            yield req
        await self._flush(ready)
        self._trim()

    async def _flush(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.deliver(list(rows))
            rows.clear()
            await self.writer.room()

    async def _until_drained(self) -> None:
        while self.n_waiting >= MAX_WAITING:
            self._drained.clear()
            await self._drained.wait()

    # -- answers ---------------------------------------------------------------------------------
    def answered(self, row: dict[str, Any], seq: int) -> list[dict[str, Any]]:
        """A leader's row (at `seq` in the writer's order): the rows of the followers waiting
        for it. Its answer is kept for the followers still to come."""
        h = row.get("request_hash")
        if h is None:
            return []
        followers = self.waiting.pop(h, None)
        self.recent[h] = _Answer(row, seq, self._started)
        self.recent.move_to_end(h)
        self._trim()
        if not followers:
            return []
        self.n_waiting -= len(followers)
        self._drained.set()
        now = row.get("completed_at") or datetime.now(UTC)
        return [self._follower(row, rid, now, reused=False) for rid in followers]

    def _trim(self) -> None:
        """Let the least recently used answers go, but only those in the warehouse (a later
        lookup finds them) that no chunk still being processed left out of its lookup."""
        written = self.writer.written
        while len(self.recent) > RECENT_ANSWERS:
            h, oldest = next(iter(self.recent.items()))
            if oldest.seq >= written or oldest.chunk >= self._processing:
                return
            del self.recent[h]
            self._evicted = True

    def _follower(
        self, source: dict[str, Any], rid: Any, now: datetime, *, reused: bool
    ) -> dict[str, Any]:
        return follower_row(
            source, rid, partition_key=self.partition_key, now=now, stats=self.stats, reused=reused
        )


def follower_row(
    source: dict[str, Any],
    rid: Any,
    *,
    partition_key: str,
    now: datetime,
    stats: RunStats,
    reused: bool,
) -> dict[str, Any]:
    """The row of `rid`, which takes `source`'s answer, counted in `stats`: nothing paid, no
    tokens, `shared_from` the source (its id, prefixed by its partition key when it is another
    partition's row). `reused`: the source was stored before this run."""
    origin = id_text(source["id"])
    pk = source.get("partition_key")
    row = {
        **source,
        "id": rid,
        "partition_key": partition_key,
        "prompt_tokens": None,
        "completion_tokens": None,
        "cost_usd": 0.0,
        "latency_ms": None,
        "total_ms": None,
        "attempts": 0,
        "shared_from": origin if pk == partition_key else f"{pk}/{origin}",
        "completed_at": now,
    }
    failed = None if row["status"] == "ok" else (row.get("error_class") or "unknown")
    stats.add_shared(failed, reused, source.get("cost_usd"))
    return row
