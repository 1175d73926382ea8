"""Redis-backed limiter shared by every process that calls one endpoint + model + key."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from dataclasses import dataclass
from importlib import resources

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import _constants as C
from .errors import LimiterUnavailableError

log = logging.getLogger(__name__)

_SCRIPT = resources.files(__package__).joinpath("limiter.lua").read_text()


def limiter_namespace(base_url: str, model: str, api_key: str | None) -> str:
    """Key prefix for one endpoint + model + key. The key is hashed; it never reaches Redis.

    The hash tag keeps every key of one limiter in one Redis Cluster slot.
    """
    key_hash = hashlib.sha256((api_key or "").encode()).hexdigest()[:16]
    digest = hashlib.sha256(f"{base_url.rstrip('/')}|{model}|{key_hash}".encode()).hexdigest()
    return f"bla:{{{model}:{digest[:16]}}}"


@dataclass(frozen=True, slots=True)
class Grant:
    """A reservation: sleep `wait_s`, then send. `factor` is the adaptive slow-down in force."""

    wait_s: float
    factor: float
    granted: bool
    share: float
    active_jobs: int


@dataclass(frozen=True, slots=True)
class LimiterSettings:
    rpm: int | None = None
    tpm: int | None = None
    burst_s: float = C.DEFAULT_BURST_S
    lease_ms: int = C.LEASE_TTL_MS
    decrease: float = C.ADAPT_DECREASE
    recovery_per_s: float = C.ADAPT_RECOVERY_PER_S
    min_factor: float = C.ADAPT_MIN_FACTOR
    cooldown_ms: int = C.ADAPT_COOLDOWN_MS
    outage_s: float = C.LIMITER_OUTAGE_S


class RedisLimiter:
    """Requests/min and tokens/min limits, fair shares and 429 back-off, one Lua call each.

    `acquire` never polls: the script returns a wait and the caller sleeps once (a job over its
    fair share under saturation makes one more call, with its slot already reserved).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str,
        settings: LimiterSettings,
        job: str = "default",
        weight: float = 1.0,
    ) -> None:
        if weight <= 0:
            raise ValueError(f"job weight must be > 0, got {weight}")
        self._redis = client
        self._script = client.register_script(_SCRIPT)
        self.settings = settings
        self.job = job
        self.weight = weight
        # The latest send time granted to this process: after a Redis restart it tells the
        # fresh state what is already scheduled (see limiter.lua).
        self._horizon = 0.0
        self.rpm = settings.rpm
        self.tpm = settings.tpm
        self._keys = [
            f"{namespace}:state",
            f"{namespace}:leases",
            f"{namespace}:weights",
            f"{namespace}:job:{job}",
        ]

    def lower_limits(self, *, rpm: int | None = None, tpm: int | None = None) -> None:
        """Adopt a lower limit reported by the provider (x-ratelimit-limit-*)."""
        if rpm and self.rpm and rpm < self.rpm:
            log.warning("Provider reports %d requests/min, below the configured %d.", rpm, self.rpm)
            self.rpm = rpm
        if tpm and self.tpm and tpm < self.tpm:
            log.warning("Provider reports %d tokens/min, below the configured %d.", tpm, self.tpm)
            self.tpm = tpm

    async def _call(self, op: str, tokens: float, extra: float, *, wait: bool = True) -> list[int]:
        s = self.settings
        args = [
            op,
            self.job,
            self.rpm or 0,
            self.tpm or 0,
            s.burst_s * 1000,
            s.lease_ms,
            self.weight,
            s.decrease,
            s.recovery_per_s,
            s.min_factor,
            s.cooldown_ms,
            tokens,
            extra,
            max(0.0, (self._horizon - time.monotonic()) * 1000),
        ]
        give_up = time.monotonic() + s.outage_s
        delay = 0.1
        while True:
            try:
                return await self._script(keys=self._keys, args=args)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                if not wait or time.monotonic() + delay > give_up:
                    raise LimiterUnavailableError(
                        description=f"Limiter Redis unreachable for {s.outage_s:.0f} s: {exc}"
                    ) from exc
                log.warning("Limiter Redis unreachable (%s); retrying in %.1f s.", exc, delay)
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, 5.0)

    async def acquire(self, tokens: int, *, deadline: float | None = None) -> Grant:
        """Reserve one request of `tokens` tokens. Returns the wait before sending.

        With a deadline (time.monotonic()), a deferral that would pass it is returned as is:
        the caller compares the wait with its deadline and refunds.
        """
        ticket = 0
        while True:
            granted, wait_us, factor, share, active = await self._call("acquire", tokens, ticket)
            grant = Grant(wait_us / 1e6, factor / 1e6, bool(granted), share / 1e6, int(active))
            self._horizon = max(self._horizon, time.monotonic() + grant.wait_s)
            if granted or (deadline is not None and time.monotonic() + grant.wait_s > deadline):
                return grant
            # Over our share while the bucket is saturated: our slot is reserved; come back then.
            await asyncio.sleep(grant.wait_s)
            ticket = 1

    async def reconcile(self, tokens_delta: float, requests_delta: float = 0) -> None:
        """Charge (positive) or refund (negative) the difference from the reservation."""
        if tokens_delta or requests_delta:
            await self._call("reconcile", tokens_delta, requests_delta)

    async def penalize(self, *, retry_after_s: float | None) -> float:
        """A 429 got through: slow the shared bucket down and pause everyone for the hint."""
        res = await self._call("penalize", 0, (retry_after_s or 0) * 1000)
        return res[2] / 1e6

    async def release(self) -> None:
        """Give up this job's lease, so its share goes to the others at once."""
        try:
            await self._call("release", 0, 0, wait=False)
        except LimiterUnavailableError:
            pass  # the lease lapses by itself
