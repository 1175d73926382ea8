"""Redis transport of the worker: llm-d's sorted set by deadline, a plain list, a retry set.

Every move is one Lua script (scripts.py), so a message is always in exactly one place: the
request sorted set (score = deadline) or list, the processing set (score = visibility expiry,
ms of Redis server time), the retry set (score = when due, s), or gone with its result written
(or to the dead-letter list). A worker that dies leaves its messages in the processing set; the
next claim by any worker moves them back once their visibility has expired (at least once,
nothing lost), and counts the delivery. Members stay bytes end to end: one that is not UTF-8
is removed by the same bytes it was claimed with.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from . import scripts


def cancel_key(msg_id: str) -> str:
    """llm-d's per-request cancellation marker: when it exists, the request is not sent."""
    return f"request-cancel:{msg_id}"


@dataclass(frozen=True, slots=True)
class QueueNames:
    """Redis keys, defaulting to llm-d's names (request-sortedset, retry-sortedset, result-list).

    Keys per id (`key` is the id, digested when long: messages.id_key): the result written
    (`done`), the answer received and not yet written (`answer`), the message in flight
    (`inflight`)."""

    request_sortedset: str = "request-sortedset"
    request_list: str | None = None
    retry_sortedset: str = "retry-sortedset"
    result_list: str = "result-list"
    result_stream: str | None = None
    processing: str | None = None  # default: "<request_sortedset>:processing"
    dead_letter: str | None = None  # default: "<request_sortedset>:dead-letter"

    @property
    def processing_set(self) -> str:
        return self.processing or f"{self.request_sortedset}:processing"

    @property
    def deliveries(self) -> str:
        return f"{self.processing_set}:deliveries"

    @property
    def dead_letter_list(self) -> str:
        return self.dead_letter or f"{self.request_sortedset}:dead-letter"

    def done_key(self, key: str) -> str:
        return f"{self.result_list}:done:{key}"

    def answer_key(self, key: str) -> str:
        return f"{self.result_list}:answer:{key}"

    def inflight_key(self, key: str) -> str:
        return f"{self.result_list}:inflight:{key}"


@dataclass(frozen=True, slots=True)
class Claim:
    members: list[bytes]
    deliveries: list[int]  # per member: times claimed without an outcome, this one included
    reclaimed: int


@dataclass(frozen=True, slots=True)
class Begin:
    """What is known of an id before sending: done, cancelled, answer (recorded, in `answer`),
    busy (another message with the id is in flight), or go (its in-flight lock is taken)."""

    state: str
    answer: str | None = None


@dataclass(frozen=True, slots=True)
class Held:
    """A member being handled here, and the in-flight lock it took ("" before it took one)."""

    member: bytes
    lock: str = ""
    token: str = ""


class RedisQueue:
    """The worker's side of the queues: claim, acknowledge with a result, retry, hand back."""

    def __init__(
        self,
        client: aioredis.Redis,
        names: QueueNames,
        *,
        visibility_ms: int,
        result_ttl_s: int,
        stream_maxlen: int = 100_000,
        reclaim_limit: int = 100,
    ) -> None:
        self.client = client
        self.names = names
        self.visibility_ms = visibility_ms
        self.result_ttl_s = result_ttl_s
        self.stream_maxlen = stream_maxlen
        self.reclaim_limit = reclaim_limit
        self._scripts = {
            name: client.register_script(getattr(scripts, name))
            for name in (
                "CLAIM",
                "PEEK",
                "BEGIN",
                "ACK",
                "MOVE",
                "DEAD_LETTER",
                "RELEASE",
                "EXTEND",
                "DROP",
            )
        }

    async def claim(self, n: int) -> Claim:
        """Move up to n messages (earliest deadline first, then the list) to processing."""
        nm = self.names
        keys = [
            nm.request_sortedset,
            nm.processing_set,
            nm.retry_sortedset,
            nm.request_list or "",
            nm.deliveries,
        ]
        args = [self.visibility_ms, n, 1 if nm.request_list else 0, self.reclaim_limit]
        out = await self._scripts["CLAIM"](keys=keys, args=args)
        return Claim([_bytes(m) for m in out[1::2]], [int(c) for c in out[2::2]], int(out[0]))

    async def heads(self, n: int) -> tuple[int, list[float]]:
        """(reclaimed, the deadlines of the next n members), after requeueing as claim does."""
        nm = self.names
        keys = [nm.request_sortedset, nm.processing_set, nm.retry_sortedset, nm.request_list or ""]
        args = [n, 1 if nm.request_list else 0, self.reclaim_limit]
        out = await self._scripts["PEEK"](keys=keys, args=args)
        return int(out[0]), [float(d) for d in out[1:]]

    async def begin(self, key: str, cancel_id: str, token: str) -> Begin:
        """Done, cancelled, answered already, busy elsewhere, or go (the lock is then ours)."""
        nm = self.names
        keys = [nm.done_key(key), cancel_key(cancel_id), nm.answer_key(key), nm.inflight_key(key)]
        out = await self._scripts["BEGIN"](keys=keys, args=[token, self.visibility_ms])
        state = _bytes(out[0]).decode()
        return Begin(state, _bytes(out[1]).decode("utf-8", "replace") if len(out) > 1 else None)

    async def record(self, key: str, result: str) -> None:
        """Keep a result before it is written: a failed write or a crash re-uses it, unpaid."""
        await self.client.set(self.names.answer_key(key), result, ex=self.result_ttl_s)

    def _result_keys(self, key: str) -> list[str]:
        nm = self.names
        return [
            nm.processing_set,
            nm.result_list,
            nm.done_key(key),
            nm.result_stream or "",
            nm.deliveries,
            nm.answer_key(key),
            nm.inflight_key(key),
        ]

    def _result_args(self, held: Held, result: str) -> list[Any]:
        stream = 1 if self.names.result_stream else 0
        return [held.member, result, self.result_ttl_s, stream, self.stream_maxlen, held.token]

    async def ack(self, held: Held, result: str, key: str) -> bool:
        """Remove the member and write its result, unless a result for `key` exists already."""
        keys = self._result_keys(key)
        return bool(await self._scripts["ACK"](keys=keys, args=self._result_args(held, result)))

    async def dead_letter(self, held: Held, result: str, key: str, entry: str) -> tuple[bool, Any]:
        """(entry kept, result: 1 written / 0 had one / the error) ; the member leaves processing."""
        keys = [*self._result_keys(key), self.names.dead_letter_list]
        args = [*self._result_args(held, result), entry]
        kept, written = await self._scripts["DEAD_LETTER"](keys=keys, args=args)
        return bool(kept), written

    async def last_failure(self, member: bytes, key: str | None) -> tuple[str | None, str | None]:
        """(why its handling last failed, the answer recorded for its id), if known: a key that
        cannot be read (another type) is unknown, so that dead-lettering never fails on it."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(self.names.deliveries, hashlib.sha1(member).hexdigest() + ":cause")
        pipe.get(self.names.answer_key(key) if key else "")
        cause, answer = await pipe.execute(raise_on_error=False)
        return _text(cause), _text(answer)

    async def drop(self, member: bytes) -> None:
        """Forget a member whose result is already written (a duplicate delivery)."""
        keys = [self.names.processing_set, self.names.deliveries]
        await self._scripts["DROP"](keys=keys, args=[member])

    async def retry(
        self, held: Held, new_member: str | bytes, delay_s: float, cause: str = ""
    ) -> bool:
        """To the retry set, due in delay_s. With a cause: a failed delivery (its count kept)."""
        nm = self.names
        keys = [nm.processing_set, nm.retry_sortedset, nm.deliveries, held.lock]
        args = [held.member, new_member, delay_s, cause, held.token]
        return bool(await self._scripts["MOVE"](keys=keys, args=args))

    async def release(self, held: list[Held]) -> int:
        """Hand members back to the request sorted set at once (no visibility wait)."""
        if not held:
            return 0
        nm = self.names
        keys = [nm.processing_set, nm.request_sortedset, nm.deliveries, *(h.lock for h in held)]
        args = [x for h in held for x in (h.member, h.token)]
        return int(await self._scripts["RELEASE"](keys=keys, args=args))

    async def extend(self, held: list[Held]) -> int:
        """Push back the visibility expiry of members still being worked on here."""
        if not held:
            return 0
        keys = [self.names.processing_set, *(h.lock for h in held)]
        args = [self.visibility_ms, *(h.member for h in held)]
        return int(await self._scripts["EXTEND"](keys=keys, args=args))

    async def backlog(self) -> dict[str, Any]:
        """Messages waiting in each structure (llm-d's broker backlog, plus ours), and the next
        in line of the sorted set and of the list (for their age)."""
        nm = self.names
        pipe = self.client.pipeline(transaction=False)
        pipe.zcard(nm.request_sortedset)
        pipe.zrange(nm.request_sortedset, 0, 0)
        if nm.request_list:
            pipe.llen(nm.request_list)
            pipe.lindex(nm.request_list, -1)
        else:
            pipe.echo(0)
            pipe.echo("")
        pipe.zcard(nm.retry_sortedset)
        pipe.zcard(nm.processing_set)
        sortedset, head, listed, tail, retry, processing = await pipe.execute()
        return {
            "request": int(sortedset) + int(listed),
            "retry": int(retry),
            "processing": int(processing),
            "next": [m for m in (*head, tail) if m],
        }


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, Exception):
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


async def submit(
    client: aioredis.Redis,
    message: dict[str, Any],
    *,
    sortedset: str | None = "request-sortedset",
    list_name: str | None = None,
) -> str:
    """Producer helper: enqueue one llm-d request message (sorted set by deadline, or a list)."""
    member = json.dumps(message, separators=(",", ":"))
    if list_name:
        await client.lpush(list_name, member)
    elif sortedset:
        await client.zadd(sortedset, {member: float(message["deadline"])})
    else:
        raise ValueError("submit needs a sorted set or a list name")
    return member
