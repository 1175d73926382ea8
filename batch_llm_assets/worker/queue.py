"""Redis transport of the worker: llm-d's sorted set by deadline, a plain list, a retry set.

Every move is one Lua script, so a message is always in exactly one place: the request
sorted set (score = deadline) or list, the processing set (score = visibility expiry, ms of
Redis server time), the retry set (score = when due, s), or gone with its result written.
A worker that dies leaves its messages in the processing set; the next claim by any worker
moves them back once their visibility has expired (at least once, nothing lost).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

# Shared by the scripts: the deadline of a member (bare message or llm-d's envelope), 0 if
# unreadable, so a malformed member sorts first and is answered INVALID_REQUEST at once.
_DEADLINE_OF = """
local function deadline_of(m)
  local ok, d = pcall(cjson.decode, m)
  if ok and type(d) == 'table' then
    if type(d.data) == 'table' then d = d.data end
    if type(d.deadline) == 'number' then return d.deadline end
  end
  return 0
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: queue zset, processing zset, retry zset, list. ARGV: visibility ms, n, use list, limit.
_CLAIM = (
    _DEADLINE_OF
    + """
local vis, n, limit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
local function requeue(src, upto)
  local moved = redis.call('ZRANGEBYSCORE', src, '-inf', upto, 'LIMIT', 0, limit)
  for _, m in ipairs(moved) do
    redis.call('ZREM', src, m)
    redis.call('ZADD', KEYS[1], deadline_of(m), m)
  end
  return #moved
end
local reclaimed = requeue(KEYS[2], now_ms)
requeue(KEYS[3], now_ms / 1000)
local out = {reclaimed}
if n > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[1], n)
  for i = 1, #popped, 2 do
    redis.call('ZADD', KEYS[2], now_ms + vis, popped[i])
    out[#out + 1] = popped[i]
  end
  if ARGV[3] == '1' then
    while #out <= n do
      local m = redis.call('RPOP', KEYS[4])
      if not m then break end
      redis.call('ZADD', KEYS[2], now_ms + vis, m)
      out[#out + 1] = m
    end
  end
end
return out
"""
)

# KEYS: processing, result list, done key, stream. ARGV: member, result, ttl s, use stream, maxlen.
_ACK = """
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('SET', KEYS[3], '1', 'NX', 'EX', ARGV[3]) then
  redis.call('LPUSH', KEYS[2], ARGV[2])
  if ARGV[4] == '1' then
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[5], '*', 'result', ARGV[2])
  end
  return 1
end
return 0
"""

# KEYS: processing, retry zset. ARGV: member, member to re-enqueue, delay s.
_RETRY = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[2], tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[3]), ARGV[2])
  return 1
end
return 0
"""

# KEYS: processing, queue zset. ARGV: members handed back (graceful shutdown).
_RELEASE = (
    _DEADLINE_OF
    + """
local n = 0
for _, m in ipairs(ARGV) do
  if redis.call('ZREM', KEYS[1], m) == 1 then
    redis.call('ZADD', KEYS[2], deadline_of(m), m)
    n = n + 1
  end
end
return n
"""
)

# KEYS: processing. ARGV: visibility ms, members still in flight here (heartbeat).
_EXTEND = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', until_ms, ARGV[i])
end
return n
"""


def cancel_key(msg_id: str) -> str:
    """llm-d's per-request cancellation marker: when it exists, the request is not sent."""
    return f"request-cancel:{msg_id}"


@dataclass(frozen=True, slots=True)
class QueueNames:
    """Redis keys, defaulting to llm-d's names (request-sortedset, retry-sortedset, result-list)."""

    request_sortedset: str = "request-sortedset"
    request_list: str | None = None
    retry_sortedset: str = "retry-sortedset"
    result_list: str = "result-list"
    result_stream: str | None = None
    processing: str | None = None  # default: "<request_sortedset>:processing"

    @property
    def processing_set(self) -> str:
        return self.processing or f"{self.request_sortedset}:processing"

    def done_key(self, key: str) -> str:
        return f"{self.result_list}:done:{key}"


@dataclass(frozen=True, slots=True)
class Claim:
    members: list[str]
    reclaimed: int


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
        self._claim = client.register_script(_CLAIM)
        self._ack = client.register_script(_ACK)
        self._retry = client.register_script(_RETRY)
        self._release = client.register_script(_RELEASE)
        self._extend = client.register_script(_EXTEND)

    async def claim(self, n: int) -> Claim:
        """Move up to n messages (earliest deadline first, then the list) to processing."""
        nm = self.names
        keys = [nm.request_sortedset, nm.processing_set, nm.retry_sortedset, nm.request_list or ""]
        args = [self.visibility_ms, n, 1 if nm.request_list else 0, self.reclaim_limit]
        out = await self._claim(keys=keys, args=args)
        return Claim([_text(m) for m in out[1:]], int(out[0]))

    async def ack(self, member: str, result: str, key: str) -> bool:
        """Remove the member and write its result, unless a result for `key` exists already."""
        nm = self.names
        keys = [nm.processing_set, nm.result_list, nm.done_key(key), nm.result_stream or ""]
        stream = 1 if nm.result_stream else 0
        args = [member, result, self.result_ttl_s, stream, self.stream_maxlen]
        return bool(await self._ack(keys=keys, args=args))

    async def state(self, msg_id: str) -> tuple[bool, bool]:
        """(result already written, cancelled by the producer) for one id, in one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.exists(self.names.done_key(msg_id))
        pipe.exists(cancel_key(msg_id))
        done, cancelled = await pipe.execute()
        return bool(done), bool(cancelled)

    async def drop(self, member: str) -> None:
        """Forget a member whose result is already written (a duplicate delivery)."""
        await self.client.zrem(self.names.processing_set, member)

    async def retry(self, member: str, new_member: str, delay_s: float) -> bool:
        keys = [self.names.processing_set, self.names.retry_sortedset]
        return bool(await self._retry(keys=keys, args=[member, new_member, delay_s]))

    async def release(self, members: list[str]) -> int:
        """Hand members back to the request sorted set at once (no visibility wait)."""
        if not members:
            return 0
        keys = [self.names.processing_set, self.names.request_sortedset]
        return int(await self._release(keys=keys, args=members))

    async def extend(self, members: list[str]) -> int:
        """Push back the visibility expiry of members still being worked on here."""
        if not members:
            return 0
        keys = [self.names.processing_set]
        return int(await self._extend(keys=keys, args=[self.visibility_ms, *members]))

    async def backlog(self) -> dict[str, int]:
        """Messages waiting in each structure (llm-d's broker backlog, plus ours)."""
        nm = self.names
        pipe = self.client.pipeline(transaction=False)
        pipe.zcard(nm.request_sortedset)
        if nm.request_list:
            pipe.llen(nm.request_list)
        else:
            pipe.echo(0)
        pipe.zcard(nm.retry_sortedset)
        pipe.zcard(nm.processing_set)
        sortedset, listed, retry, processing = await pipe.execute()
        return {
            "request": int(sortedset) + int(listed),
            "retry": int(retry),
            "processing": int(processing),
        }


def _text(value: Any) -> str:
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
