"""Partition leases in the shared Redis: one key per partition, claimed by one small script.

A failover (READONLY, MASTERDOWN), a cluster moving slots (MOVED, ASK, TRYAGAIN, CLUSTERDOWN),
a server loading its data (LOADING), a lost connection: an outage, waited out (told apart by
redis-py's exception classes, `engine/redis_client.error_kind`). Messages name the server
without its password (`safe_url`).
"""

from __future__ import annotations

import redis
from redis.cluster import RedisCluster

from ..engine import _constants as C
from ..engine.redis_client import error_kind, safe_url
from ..warehouses.base import LeaseStore

KEY_PREFIX = "batch_llm:partition_lease:"

# Free, lapsed (Redis dropped the key), ours, or the dead holder's we replace: ours now.
_CLAIM = """
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[1] and v ~= ARGV[3] then
  return v
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def sync_client(url: str) -> redis.Redis | RedisCluster:
    """A blocking client for the URLs `engine/redis_client.connect_redis` takes."""
    opts = {
        "socket_timeout": C.REDIS_CONNECT_TIMEOUT_S,
        "socket_connect_timeout": C.REDIS_CONNECT_TIMEOUT_S,
    }
    for prefix in ("redis+cluster://", "rediss+cluster://"):
        if url.startswith(prefix):
            return RedisCluster.from_url(url.replace("+cluster", "", 1), **opts)
    return redis.Redis.from_url(url, **opts)


class RedisLeaseStore(LeaseStore):
    def __init__(self, url: str, *, ttl_s: float = C.LEASE_TTL_S) -> None:
        self.where = f"Redis at {safe_url(url)}"
        self.ttl_s = ttl_s
        self._url = url
        self._client: redis.Redis | RedisCluster | None = None

    def _scripts(self):
        if self._client is None:  # connecting may fail: inside claim, where errors are handled
            self._client = sync_client(self._url)
            self._claim = self._client.register_script(_CLAIM)
            self._release = self._client.register_script(_RELEASE)
        return self._claim, self._release

    def claim(self, name: str, holder: str, *, replacing: str | None = None) -> str | None:
        claim, _ = self._scripts()
        ttl_ms = max(1, int(self.ttl_s * 1000))
        raw = claim(keys=[KEY_PREFIX + name], args=[holder, ttl_ms, replacing or ""])
        return raw.decode() if isinstance(raw, bytes) else raw

    def release(self, name: str, holder: str) -> None:
        _, release = self._scripts()
        release(keys=[KEY_PREFIX + name], args=[holder])

    def transient(self, exc: BaseException) -> bool:
        return isinstance(exc, redis.RedisError | OSError) and error_kind(exc) == "outage"

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
