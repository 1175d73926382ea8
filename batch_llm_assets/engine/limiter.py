"""Redis-backed limiter shared by every process that calls one endpoint + model + key."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import time
import uuid
from dataclasses import dataclass, replace
from importlib import resources

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import _constants as C
from .errors import LimiterUnavailableError
from .redis_client import check_redis, connect_redis  # noqa: F401 (re-exported)
from .usage import ProviderLimits

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
    slot_ms: int = 0  # the granted send time on the Redis clock (0: no limiter)
    # time.monotonic() when the call that granted it was sent (after any deferral): a shared
    # pause that began after it is one the slot does not know about.
    asked_at: float = math.inf
    burst_ms: int = 0  # the burst it was granted under


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
    probe_slowdown: float = C.ADAPT_PROBE_SLOWDOWN
    max_learned_burst_s: float = C.MAX_LEARNED_BURST_S


# Response errors that pass: a failover in progress (READONLY, MASTERDOWN), a cluster moving
# slots (MOVED, ASK, TRYAGAIN, CLUSTERDOWN), a server loading its data (LOADING), a busy script.
_TRANSIENT_REPLIES = (
    "READONLY",
    "MOVED",
    "ASK",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "LOADING",
    "BUSY",
    "MASTERDOWN",
)


def _transient(exc: Exception) -> bool:
    if isinstance(exc, AuthenticationError):
        return False
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError):
        return True
    return isinstance(exc, ResponseError) and str(exc).startswith(_TRANSIENT_REPLIES)


class _Warnings:
    """One log line per kind per `every_s` seconds, with how many were held back."""

    def __init__(self, every_s: float = C.WARN_EVERY_S) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def __call__(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -1e9) < self.every_s:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        log.warning(msg + (f" ({held} more like it not shown)" if held else ""), *args)


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
        self.warn = _Warnings()
        self._limits_checked = False
        # Every limited dimension's rate is one the provider states (x-ratelimit-limit-*, per
        # minute): an isolated 429 then says a send came at the bucket's edge, not that the rate
        # is too high, and costs a milder decrease (`penalize`, limiter.lua).
        self.limits_stated = False
        self.window_s = 0.0  # the provider's window, when the engine has seen it enforce one
        self._keys = [
            f"{namespace}:state",
            f"{namespace}:leases",
            f"{namespace}:weights",
            f"{namespace}:job:{job}",
            f"{namespace}:engines",
        ]
        self.engine_id = uuid.uuid4().hex  # this process's run on the key (see `settled`)
        # The engine's token counts agree with the provider's (its calibration has settled):
        # alone on the key, it may then burst closer to the provider's bucket (limiter.lua).
        self.settled = False
        self._clock_ms = -math.inf  # Redis ms less time.monotonic() ms (see `_note_clock`)
        self.only_engine = False  # the only engine on the key, as of the latest observe
        # The adaptive slow-down in force as of the latest reply (1: none; a 429 lowers it).
        self.factor = 1.0
        # The latest observe raised the tokens' schedule to the provider's remaining.
        self.clamped_tokens = False

    async def prepare(self) -> None:
        """Load the script once before the first wave of acquires: otherwise every one of them
        gets NOSCRIPT and sends the whole script again."""
        try:
            await self._redis.script_load(_SCRIPT)
        except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError):
            pass  # the acquires load it themselves, and handle the error there

    @property
    def max_request_tokens(self) -> int | None:
        """The largest request the tokens/min limit can ever admit (OpenAI rejects larger)."""
        return self.tpm

    def lower_limits(
        self, *, rpm: int | None = None, tpm: int | None = None, source: str = "reports"
    ) -> None:
        """Adopt a lower limit the provider shows (x-ratelimit-limit-*, or the refill its
        x-ratelimit-reset-* show: `source` says which, for the warning)."""
        if rpm and self.rpm and rpm < self.rpm:
            log.warning(
                "Provider %s %d requests/min, below the configured %d.", source, rpm, self.rpm
            )
            self.rpm = rpm
        if tpm and self.tpm and tpm < self.tpm:
            log.warning(
                "Provider %s %d tokens/min, below the configured %d.", source, tpm, self.tpm
            )
            self.tpm = tpm

    def adopt_refill(self, *, rpm: int | None = None, tpm: int | None = None) -> None:
        """Adopt the refill the provider's x-ratelimit-reset-* show (provider_gate.py), below
        the configured rate: it is the provider's own, as a stated limit is (`limits_stated`;
        the limit that binds is the one a job's first burst draws down, and so reads)."""
        self.lower_limits(rpm=rpm, tpm=tpm, source="resets show a refill of")
        self.limits_stated = True

    async def _call(
        self,
        op: str,
        tokens: float,
        extra: float,
        *,
        wait: bool = True,
        more: tuple[float, float, float] = (0, -1, -1),
        snapshot_ms: float = 0.0,
        costs: str = "",
        mild: float = 0,
    ) -> list[int]:
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
            *more,
            s.probe_slowdown,
            s.max_learned_burst_s * 1000,
            self.window_s * 1000,
            self.engine_id,
            int(self.settled),
            snapshot_ms,
            costs,
            mild,
        ]
        give_up = time.monotonic() + s.outage_s
        delay = 0.1
        while True:
            try:
                return await self._script(keys=self._keys, args=args)
            except AuthenticationError as exc:
                raise LimiterUnavailableError(
                    description=f"Limiter Redis refused the credentials: {exc}"
                ) from exc
            except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError) as exc:
                kind = type(exc).__name__
                if not _transient(exc):  # OOM, NOSCRIPT that would not load, a script error...
                    raise LimiterUnavailableError(
                        description=f"Limiter Redis answered an error ({kind}): {exc}"
                    ) from exc
                if not wait or time.monotonic() + delay > give_up:
                    raise LimiterUnavailableError(
                        description=f"Limiter Redis unavailable for {s.outage_s:.0f} s: {exc}"
                    ) from exc
                self.warn(kind, "Limiter Redis unavailable (%s); retrying.", exc)
                await asyncio.sleep(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, 5.0)

    async def acquire(self, tokens: int, *, deadline: float | None = None) -> Grant:
        """Reserve one request of `tokens` tokens. Returns the wait before sending.

        With a deadline (time.monotonic()), a deferral that would pass it is returned as is:
        the caller compares the wait with its deadline and refunds.
        """
        ticket = 0
        while True:
            asked_at = time.monotonic()
            res = await self._call("acquire", tokens, ticket)
            granted, wait_us, factor, share, active = res[:5]
            self.factor = factor / 1e6
            # A grant's sixth value is its send time; a deferral's, the ticket: the time its
            # job reserved for it on the limiter's virtual clock.
            slot = int(res[5]) if granted and len(res) > 5 else 0
            self._note_clock(res)
            grant = Grant(
                wait_us / 1e6,
                factor / 1e6,
                bool(granted),
                share / 1e6,
                int(active),
                slot,
                asked_at,
                int(res[7]) if granted and len(res) > 7 else 0,
            )
            self._horizon = max(self._horizon, time.monotonic() + grant.wait_s)
            if granted or (deadline is not None and time.monotonic() + grant.wait_s > deadline):
                return grant
            # Over our share while the bucket is saturated: our slot is reserved; come back then.
            await asyncio.sleep(grant.wait_s)
            ticket = int(res[5]) if len(res) > 5 else 1

    async def reconcile(self, tokens_delta: float, requests_delta: float = 0) -> None:
        """Charge (positive) or refund (negative) the difference from the reservation."""
        if tokens_delta or requests_delta:
            await self._call("reconcile", tokens_delta, requests_delta)

    async def reslot(self, held: list[Grant], costs: list[int]) -> list[Grant]:
        """Give back slots granted under a narrower burst and take them again, in their order,
        under the burst now in force, in one call (see limiter.lua). For a job alone on the key;
        `held` in the order of their slots.
        Raises LimiterUnavailableError at once if Redis cannot take it: the old slots hold."""
        asked_at = time.monotonic()
        res = await self._call(
            "reslot",
            sum(costs),
            0,
            wait=False,
            more=(held[0].slot_ms + held[0].burst_ms, -1, -1),
            costs=",".join(str(int(c)) for c in costs),
        )
        factor = int(res[0]) / 1e6
        self.factor = factor
        self._note_redis_now(int(res[1]))
        grants = [
            replace(
                old,
                wait_s=int(res[2 + 2 * i]) / 1000,
                factor=factor,
                slot_ms=int(res[3 + 2 * i]),
                asked_at=asked_at,
            )
            for i, old in enumerate(held)
        ]
        if grants:
            self._horizon = max(self._horizon, time.monotonic() + max(g.wait_s for g in grants))
        return grants

    async def penalize(self, *, retry_after_s: float | None, slot_ms: int = 0) -> float:
        """A 429 got through: slow the shared bucket down (once per overload event: `slot_ms`
        of a slot granted before the last decrease does not decrease again), empty the burst,
        and pause everyone for the hint (at most MAX_SHARED_PAUSE_S)."""
        pause_ms = min(retry_after_s or 0, C.MAX_SHARED_PAUSE_S) * 1000
        mild = C.ADAPT_DECREASE_STATED if self.limits_stated else 0
        res = await self._call("penalize", 0, pause_ms, more=(slot_ms, -1, -1), mild=mild)
        self.factor = res[2] / 1e6
        return self.factor

    async def observe(self, limits: ProviderLimits, *, sent_at: float | None = None) -> float:
        """Fold the provider's x-ratelimit-* state into the shared schedule; returns the burst
        (seconds) now in force, grown to the provider's bucket as its headers show it.

        `sent_at` (time.monotonic()): when the request whose answer this is went. The provider
        took its snapshot on arrival, so its bucket has refilled since: by the time the answer
        is back (seconds, for a model that writes a long answer) and this call runs."""
        self._adopt_limits(limits)
        if limits.remaining_tokens is None and limits.remaining_requests is None:
            return self.settings.burst_s

        def ms(v: float | None) -> float:
            return -1 if v is None else v * 1000

        snapshot_ms = 0.0
        if sent_at is not None and self._clock_ms > -math.inf:
            snapshot_ms = (sent_at + C.SNAPSHOT_LAG_S) * 1000 + self._clock_ms
        res = await self._call(
            "observe",
            "" if limits.remaining_tokens is None else limits.remaining_tokens,
            0,
            more=(
                "" if limits.remaining_requests is None else limits.remaining_requests,
                ms(limits.reset_tokens_s),
                ms(limits.reset_requests_s),
            ),
            snapshot_ms=snapshot_ms,
        )
        self._note_clock(res)
        self.factor = res[2] / 1e6
        if len(res) > 7:
            self.only_engine = int(res[7]) == 1
        self.clamped_tokens = len(res) > 8 and int(res[8]) == 1
        return res[5] / 1000 if len(res) > 5 else self.settings.burst_s

    def _note_clock(self, res: list[int]) -> None:
        """Learn Redis's clock against time.monotonic() from a reply carrying Redis now (us).

        Redis ran the script before the reply came back, so `redis now - monotonic at the
        reply` is at most the true offset; the largest seen is the closest. An observe's
        snapshot time is sent in Redis's clock: its call can wait for a connection for tenths
        of a second while the answers of a burst come in, and a snapshot aged from when the
        script runs would be that much too young (the schedule held that much short)."""
        if len(res) > 6:  # a grant's or an observe's seventh value
            self._note_redis_now(int(res[6]))

    def _note_redis_now(self, redis_now_us: int) -> None:
        sample = redis_now_us / 1000 - time.monotonic() * 1000
        self._clock_ms = max(sample, self._clock_ms)

    def _adopt_limits(self, limits: ProviderLimits) -> None:
        """Lower rpm/tpm to what x-ratelimit-limit-* (with remaining and reset) says; once."""
        if self._limits_checked:
            return
        self._limits_checked = True
        self.lower_limits(
            rpm=_per_minute(
                limits.limit_requests,
                limits.remaining_requests,
                limits.reset_requests_s,
                self.rpm,
            ),
            tpm=_per_minute(
                limits.limit_tokens, limits.remaining_tokens, limits.reset_tokens_s, self.tpm
            ),
        )
        # Stated: a figure at or above the rate now in force (so a per-minute one, not a
        # bucket's capacity), for each dimension limited.
        self.limits_stated = all(
            stated is not None and rate <= stated
            for rate, stated in ((self.rpm, limits.limit_requests), (self.tpm, limits.limit_tokens))
            if rate
        )

    async def release(self) -> None:
        """Give up this job's lease, so its share goes to the others at once."""
        try:
            await self._call("release", 0, 0, wait=False)
        except LimiterUnavailableError:
            pass  # the lease lapses by itself


def _per_minute(
    limit: int | None, remaining: int | None, reset_s: float | None, configured: int | None
) -> int | None:
    """The per-minute limit that x-ratelimit-limit-* (read with remaining and reset) implies.

    OpenAI sends a per-minute figure; some servers send their bucket's capacity (a few seconds
    of the rate) instead. A figure of at least half the configured limit is taken as per-minute.
    A smaller one may be a capacity: then the refill it implies, (limit - remaining) / reset,
    is the rate; adopted when below the configured one."""
    if not limit or not configured or limit >= configured:
        return None
    if limit >= configured / 2:
        return limit
    if remaining is None or not reset_s or remaining >= limit:
        return None
    implied = int(60 * (limit - remaining) / reset_s)
    return implied if implied < configured else None
