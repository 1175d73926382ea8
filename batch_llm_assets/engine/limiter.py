"""The shared limiter's client: one Lua call per op (limiter.lua), named arguments, Redis errors
told apart (redis_client.py), an outage waited out for a bounded time."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources

import redis.asyncio as aioredis
from redis import exceptions as rx

from . import _constants as C
from .errors import LimiterError
from .redis_client import Warnings, backoff, call_script, check_redis, connect_redis, error_kind

__all__ = ["Grant", "LimiterSettings", "RedisLimiter", "check_redis", "connect_redis"]

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
    """A reservation: sleep `wait_s`, then send. What it reserved (`tokens`, one request) and
    where (`slot_ms`, Redis time) is what a give-back returns; `epoch` counts the overload
    events the limiter had seen when it granted it (a later one made it stale)."""

    wait_s: float
    slot_ms: int = 0
    epoch: int = 0
    tokens: int = 0
    factor: float = 1.0
    share: float = 1.0
    active_jobs: int = 0
    burst_s: float = 0.0
    granted: bool = True
    deferred: bool = False  # not granted: held to its job's share, its own slot reserved


@dataclass(frozen=True, slots=True)
class LimiterSettings:
    """The configured limits (a ceiling: the provider's headers may only lower them)."""

    rpm: int | None = None
    tpm: int | None = None
    burst_s: float = C.DEFAULT_BURST_S
    lease_ms: int = C.JOB_LEASE_TTL_MS
    outage_s: float = C.LIMITER_OUTAGE_S
    reach_s: float = C.GRANT_REACH_S  # no slot granted further ahead (a test reads far slots)


class RedisLimiter:
    """Requests/min and tokens/min shared by every process on one key, through limiter.lua.

    `rpm` and `tpm` are the limits believed now: the configured ones, lowered by what the
    provider states (`believe`). `factor`, `epoch` and `burst_s` are as of the latest reply.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str,
        settings: LimiterSettings,
        job: str = "default",
        weight: float = 1.0,
        where: str = "redis",
    ) -> None:
        if not 0 < weight < math.inf:
            raise ValueError(f"job weight must be a finite number > 0, got {weight}")
        self._redis = client
        self._script = client.register_script(_SCRIPT)
        self.settings = settings
        self.job = job
        self.weight = weight
        self.engine_id = uuid.uuid4().hex[:16]  # this engine's own lease, released by it alone
        self.rpm, self.tpm = settings.rpm, settings.tpm
        self.factor = 1.0
        self.epoch = 0
        self.burst_s = settings.burst_s
        # Told of every reply (the pacer wakes its sleepers when their slots went stale): a
        # reply to a request still in line, or to a give-back, carries a new epoch too.
        self.on_reply: Callable[[], None] | None = None
        self.warn = Warnings()
        self._where = where
        self._horizon = 0.0  # the latest send time granted here (monotonic): see limiter.lua
        self._line = asyncio.Lock()  # requests not granted at once wait here, one asking
        keys = ("state", "leases", "jobs", f"job:{job}", "ledger:r", "ledger:t")
        self._keys = [f"{namespace}:{k}" for k in keys]
        self._watcher: asyncio.Task[None] | None = None

    async def prepare(self) -> None:
        """Load the script once before the first wave of acquires (each would get NOSCRIPT and
        send the whole script)."""
        try:
            await self._redis.script_load(_SCRIPT)
        except (rx.RedisError, OSError):
            pass  # the calls load it themselves and report what fails

    async def _watch(self) -> None:
        """Hear every restart of the shared schedule as it happens: limiter.lua publishes each
        new epoch. Another process's 429 then reaches this engine's sleepers at once, not at its
        next reply, up to a reach later, during which they would go out on the old schedule into
        the window the 429 said is spent. Best effort: if Redis drops it, it subscribes again,
        and meanwhile the next reply tells; if Redis refuses it (a user without channel rights),
        it stops, once: retrying would not change the answer."""
        delay = C.LIMITER_RETRY_DELAY_S
        while True:
            try:
                async with self._redis.pubsub(ignore_subscribe_messages=True) as ps:
                    await ps.subscribe(f"{self._keys[0]}:epoch")
                    delay = C.LIMITER_RETRY_DELAY_S
                    while True:  # a finite wait: the client's socket timeout would end it
                        message = await ps.get_message(timeout=C.EPOCH_LISTEN_S)
                        if _cancelled():  # redis-py's read timeout can swallow a cancel
                            raise asyncio.CancelledError
                        if message is not None:
                            self._heard(message.get("data"))
            except (rx.RedisError, OSError) as exc:
                outage = error_kind(exc) == "outage"
                self.warn(
                    "watch",
                    "Not hearing other processes' 429s at once%s (each reply still tells): %s",
                    "" if outage else ", for this engine's life",
                    exc,
                )
                if not outage:
                    return
                delay = await backoff(delay)

    def _heard(self, data: object) -> None:
        try:
            epoch = int(data)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            return  # not the script's: someone else's message on the channel
        # Anyone with write access may publish here, and what is heard reaches the state (`seen`).
        if epoch > self.epoch and epoch < C.MAX_EPOCH:
            self.epoch = epoch
            if self.on_reply is not None:
                self.on_reply()

    @property
    def max_request_tokens(self) -> int | None:
        """The largest request the tokens/min limit can ever admit (OpenAI rejects larger)."""
        return self.tpm

    def believe(self, *, rpm: int | None, tpm: int | None) -> bool:
        """The provider's stated per-minute limits: believed when under the configured ones (a
        ceiling), and followed both ways below it. True if a believed limit fell."""
        fell = False
        for name, stated in (("rpm", rpm), ("tpm", tpm)):
            configured = getattr(self.settings, name)
            if not configured or stated is None:
                continue
            believed = min(configured, stated)
            if believed != getattr(self, name):
                log.warning(
                    "Provider states %s %d; the limiter now uses %d (configured %d).",
                    name,
                    stated,
                    believed,
                    configured,
                )
                fell = fell or believed < (getattr(self, name) or 0)
                setattr(self, name, believed)
        return fell

    def _common(self) -> list[object]:
        ahead = max(0.0, (self._horizon - time.monotonic()) * 1000)
        return [
            *("job", self.job, "engine", self.engine_id),
            *("rpm", self.rpm or 0, "tpm", self.tpm or 0, "burst_ms", self.settings.burst_s * 1000),
            *("recovery", C.ADAPT_RECOVERY_PER_S, "slowdown", C.ADAPT_PROBE_SLOWDOWN),
            *("knee", C.ADAPT_KNEE),
            *("min_factor", C.ADAPT_MIN_FACTOR, "ahead", ahead),
            *("wider", C.BURST_WIDER_RATIO, "forgive_ms", C.LULL_FORGIVE_MS),
            *("ttl_ms", C.STATE_TTL_MARGIN_MS, "seen", self.epoch),
        ]

    async def _call(self, op: str, *named: object, wait: bool = True) -> Grant:
        res = await call_script(
            self._script,
            keys=self._keys,
            args=[op, *self._common(), *named],
            where=self._where,
            doing=f"running {op}",
            outage_s=self.settings.outage_s,
            wait=wait,
            warn=self.warn,
        )
        granted, wait_ms, slot, factor, share, jobs, epoch, burst = (int(x) for x in res)
        self.factor, self.epoch, self.burst_s = factor / 1e6, epoch, burst / 1000
        if self.on_reply is not None:
            self.on_reply()
        got = (wait_ms / 1000, slot, epoch, 0, factor / 1e6, share / 1e6, jobs, burst / 1000)
        return Grant(*got, granted=granted == 1, deferred=granted == 0)

    async def acquire(
        self,
        tokens: int | Callable[[], int],
        *,
        deadline: float | None = None,
        give_back: Grant | None = None,
    ) -> Grant:
        """Reserve one request of `tokens` tokens: the wait before sending. `give_back` returns
        an older grant's reservation in the same call (a fresh slot for a stale one). `tokens`
        may be a function, asked at each call to Redis: a request that waits in line reserves
        what it is known to cost by then (the pacer's calibration, learnt meanwhile).

        Not granted at once: a job over its share while the schedule is saturated (its own slot
        reserved, it asks again with a ticket), or a slot beyond GRANT_REACH_S (nothing
        reserved): such requests of this engine wait in line, the first asking again when its
        wait is over. A wait past the deadline is returned as it is (not granted)."""
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())
        size = tokens if callable(tokens) else lambda: tokens
        back: list[object] = []
        if give_back is not None and give_back.granted:
            back = ["back_slot", give_back.slot_ms, "back_epoch", give_back.epoch]
            back += ["back_tokens", give_back.tokens]
        grant, ticket = None, 0
        # Others of this engine wait for the reach: it goes behind them, unless it trades a
        # stale slot (it was ahead of them).
        if back or not self._line.locked():
            grant = await self._ask(size, ticket, back)
        while grant is None or not (grant.granted or passes(deadline, grant.wait_s)):
            if grant is not None and grant.deferred:
                # Held to its share, its own slot is reserved: it sleeps to it out of the line.
                await asyncio.sleep(grant.wait_s)
                grant, ticket = await self._ask(size, 1, []), 1
                continue
            grant = await self._wait_in_line(size, ticket, grant, deadline)
        return grant

    async def _wait_in_line(
        self, size: Callable[[], int], ticket: int, grant: Grant | None, deadline: float | None
    ) -> Grant:
        """The line's head alone sleeps and asks again, until a slot within the reach is granted
        (or it is deferred for its share, or too late): one call per grant, not one per waiter."""
        due = time.monotonic() + (grant.wait_s if grant is not None else 0.0)
        async with self._line:
            while True:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                grant = await self._ask(size, ticket, [])
                if grant.granted or grant.deferred or passes(deadline, grant.wait_s):
                    return grant
                due = time.monotonic() + grant.wait_s

    async def _ask(self, size: Callable[[], int], ticket: int, back: list[object]) -> Grant:
        tokens = size()
        grant = await self._call("acquire", *self._acquire_args(tokens, ticket), *back)
        if grant.granted:
            self._horizon = max(self._horizon, time.monotonic() + grant.wait_s)
        return replace(grant, tokens=tokens)

    def _acquire_args(self, tokens: int, ticket: int) -> list[object]:
        s = self.settings
        return [
            *("tokens", tokens, "ticket", ticket, "weight", self.weight),
            *("lease_ms", s.lease_ms, "state_leases", C.JOB_STATE_TTL_LEASES),
            *("share_tau_ms", C.SHARE_TAU_MS, "idle", C.SHARE_IDLE),
            *("ceil_rpm", s.rpm or 0, "ceil_tpm", s.tpm or 0),
            *("free_ms", C.CEILING_FREE_BURST_S * 1000, "reach_ms", s.reach_s * 1000),
        ]

    async def settle(
        self,
        grant: Grant,
        *,
        tokens: float = 0,
        requests: int = 0,
        view: dict[str, float] | None = None,
        ok: bool = False,
    ) -> None:
        """An answer: charge (or give back) the difference from the reservation, and hold the
        schedule to the provider's state (`view`: rem_r / rem_t remaining, reset_r / reset_t ms
        to a window's reset, cap_ms the burst its bucket allows, restart 1 when the believed rate
        fell so the slots granted at the old one are taken again; see controller.py). `ok`: it
        succeeded, so a later 429 is a new overload event (penalize)."""
        named: list[object] = ["slot", grant.slot_ms, "epoch", grant.epoch]
        named += ["tokens", tokens, "requests", requests]
        step_s = max(self.settings.burst_s, C.BURST_WIDER_STEP_S)
        named += ["max_burst_ms", C.MAX_LEARNED_BURST_S * 1000, "step_ms", step_s * 1000]
        for k, v in (view or {}).items():
            named += [k, v]
        if ok:
            named += ["ok", 1]
        if tokens or requests or view or ok:
            await self._call("settle", *named)

    async def give_back(self, grant: Grant) -> None:
        """Return a grant not used (a deadline, a breaker): best effort, it lapses otherwise."""
        if grant.granted and grant.slot_ms:
            try:
                await self.settle(grant, tokens=-grant.tokens, requests=-1)
            except LimiterError:
                pass

    async def penalize(self, grant: Grant, *, retry_after_s: float | None) -> None:
        """A 429 for the rate got through: one decrease per overload event, a shared pause for
        the server's exact hint (at most MAX_SHARED_PAUSE_S), the burst emptied."""
        pause_ms = min(max(0.0, retry_after_s or 0.0), C.MAX_SHARED_PAUSE_S) * 1000
        await self._call(
            "penalize",
            *("epoch", grant.epoch, "pause_ms", pause_ms, "decrease", C.ADAPT_DECREASE),
        )

    async def release(self) -> None:
        """Give up this engine's lease (not its job's other engines'), so its share goes at once,
        and stop listening for other processes' restarts."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        try:
            await self._call("release", wait=False)
        except LimiterError:
            pass  # the lease lapses by itself


def _cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def passes(deadline: float | None, wait_s: float) -> bool:
    """Would a send after waiting `wait_s` come after the deadline (time.monotonic())?"""
    return deadline is not None and time.monotonic() + wait_s > deadline
