"""How many requests an engine keeps in flight to a self-hosted server: the adaptive limit
(adaptive.py), enforced in this process, or shared through Redis by every run on the server.

Shared (concurrency.lua, keys under `concurrency_namespace(base_url)`): Redis holds the limit,
its base latency and each engine's requests in flight. An acquire is granted while the requests
in flight of all engines are under the limit and this engine's under its share (the limit split
evenly among the engines holding slots or refused lately), so two runs split the server instead
of each taking all of it. An engine's holding lives under a lease renewed by its calls and a
heartbeat: a run killed with SIGKILL holds nothing CONCURRENCY_LEASE_TTL_MS later. A refused
acquire asks again when one of the engine's own requests ends, or every CONCURRENCY_POLL_S
(another run's may have ended). If Redis fails, the gate goes on alone at its own limit.

The attempt timeout. No OpenAI-compatible server says, before its answer, when it started
computing a request (llama.cpp's `timings` come with the answer), so the timeout cannot count
from there. It is raised instead, to ADAPTIVE_TIMEOUT_FACTOR x the slowest of the latest answers
when that is longer: a request queued behind others is not given up (and sent again) while the
server, which goes on computing it anyway, has it in hand; a request that hangs still ends.

Answers with rate-limit headers (x-ratelimit-*, or a gateway's RateLimit-*: usage.py) come from
a rate-limited endpoint (a gateway in front of the server): the gate then holds max_concurrency,
as for a hosted API.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from redis import exceptions as rx

from . import _constants as C
from . import errors as E
from .adaptive import Limit, Window, check_concurrency
from .cancel import cancel_and_wait
from .usage import parse_limits

log = logging.getLogger(__name__)

_SCRIPT = resources.files(__package__).joinpath("concurrency.lua").read_text()


def concurrency_namespace(base_url: str) -> str:
    """Key prefix for one server (every model and key on it shares its slots)."""
    digest = hashlib.sha256(base_url.rstrip("/").encode()).hexdigest()[:16]
    return f"bla:{{conc:{digest}}}"


def held(gate: ConcurrencyGate | None) -> contextlib.AbstractAsyncContextManager[Any]:
    """A place in the gate for the block; no gate, no wait."""
    return gate.slot() if gate is not None else contextlib.nullcontext()


class ConcurrencyGate:
    """Requests in flight to one server from one engine: `acquire` before sending, `release`
    after, `observe` each answer's latency; `timeout` the attempt's timeout."""

    def __init__(
        self,
        *,
        max_concurrency: int,
        client: Any = None,
        namespace: str | None = None,
        lease_ms: int = C.CONCURRENCY_LEASE_TTL_MS,
        start: int = C.ADAPTIVE_START_LIMIT,
    ) -> None:
        self.max = check_concurrency(max_concurrency)
        self.state = Limit(float(min(check_concurrency(start, "start"), self.max)))
        self.adaptive = True  # False once answers carry rate-limit headers
        self.inflight = self.peak_inflight = self.refused = self.grown = self.shrunk = 0
        self.peak_limit = self.limit
        self._window = Window()
        self._slow: deque[float] = deque(maxlen=C.ADAPTIVE_TIMEOUT_SAMPLES)
        self._turn = asyncio.Lock()  # one waiter asks at a time, first come first served
        self._freed = asyncio.Event()
        self._shared = _Shared(client, namespace, lease_ms) if client is not None else None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def limit(self) -> int:
        if not self.adaptive:
            return self.max
        return max(1, min(self.max, int(self.state.value)))

    # -- slots -------------------------------------------------------------------------------
    async def acquire(self) -> None:
        async with self._turn:
            while True:
                self._freed.clear()
                if await self._try():
                    break
                self.refused += 1
                self._window.filled = True
                poll = C.CONCURRENCY_POLL_S if self._remote else None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), poll)
            self.inflight += 1
            self.peak_inflight = max(self.peak_inflight, self.inflight)
            if self.inflight >= self.limit:
                self._window.filled = True

    @property
    def _remote(self) -> bool:
        return self._shared is not None and self.adaptive and not self._shared.failed

    async def _try(self) -> bool:
        if self.inflight >= self.limit:
            return False
        if not self._remote:
            return True
        reply = await self._shared.call("acquire", start=self.state.value)
        if reply is None:  # Redis failed: this engine goes on alone
            return True
        self._take(reply[1:])
        return bool(reply[0])

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """A place among the requests in flight, for the block."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    def release(self) -> None:
        self.inflight -= 1
        if self._remote:
            self._spawn(self._shared.call("release"))
        self._freed.set()

    # -- answers -----------------------------------------------------------------------------
    def timeout(self, configured: float) -> float:
        """The attempt's timeout: the configured one, raised for a slow server (module doc)."""
        raised = C.ADAPTIVE_TIMEOUT_FACTOR * max(self._slow, default=0.0)
        return max(configured, min(C.ADAPTIVE_MAX_TIMEOUT_S, raised))

    def observe(self, sent_at: float, outcome: Any) -> None:
        """An attempt's outcome (an answer, or the ProviderError it raised), sent at `sent_at`
        (time.perf_counter()). Only answers count: an error's time says nothing of the load (a
        server that is down answers at once, one that hangs never)."""
        if isinstance(outcome, E.ProviderError):
            return
        if not parse_limits(outcome.headers or {}).empty:
            self._fixed()
            return
        latency = time.perf_counter() - sent_at
        self._slow.append(latency)
        if self.adaptive and self._window.add(sent_at, latency) and self._window.full(self.limit):
            self._decide()

    def _decide(self) -> None:
        old = self.state
        new = self._window.decide(old, self.max)
        new = Limit(round(new.value, 3), new.base_s, new.growing)
        if self._remote:
            named = {"from": old.value, "to": new.value, "growing": int(new.growing)}
            named |= {"base_us": round(new.base_s * 1e6), "rebase": int(new.base_s > old.base_s)}
            self._spawn(self._adjust(named))
        self._set(new)

    async def _adjust(self, named: dict[str, Any]) -> None:
        reply = await self._shared.call("adjust", start=named["from"], **named)
        if reply is not None:
            self._take(reply[1:])

    def _take(self, reply: list[int]) -> None:
        """The shared state as Redis replied (limit x 1000, base us, growing)."""
        limit, base_us, growing = reply[0], reply[1], reply[2]
        self._set(Limit(limit / 1000, base_us / 1e6, bool(growing)))

    def _set(self, new: Limit) -> None:
        before = self.limit
        self.state = new
        if self.limit > before:
            self.grown += 1
            self._freed.set()
        elif self.limit < before:
            self.shrunk += 1
        self.peak_limit = max(self.peak_limit, self.limit)
        if self.limit != before:
            log.debug("Concurrency limit %d -> %d (base %.3f s)", before, self.limit, new.base_s)

    def _fixed(self) -> None:
        """Rate-limit headers: a rate-limited endpoint, held at max_concurrency from now on."""
        if not self.adaptive:
            return
        log.info(
            "The server sends rate-limit headers: max_concurrency %d applies, not an adaptive "
            "limit.",
            self.max,
        )
        if self._remote:
            self._spawn(self._shared.call("leave"))
        self.adaptive = False
        self._freed.set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Give the slots back at once (not a lease later)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5.0)
        if self._shared is not None:
            await self._shared.close()


class _Shared:
    """This engine's calls to concurrency.lua, its heartbeat, and what a failed call means."""

    def __init__(self, client: Any, namespace: str | None, lease_ms: int) -> None:
        if namespace is None:
            raise ValueError("a shared concurrency gate needs a namespace")
        self._script = client.register_script(_SCRIPT)
        self._keys = [f"{namespace}:{k}" for k in ("state", "held", "alive", "want")]
        self.engine = uuid.uuid4().hex[:16]
        self.lease_ms = lease_ms
        self.failed = False
        self._beat: asyncio.Task[None] | None = None

    async def call(self, op: str, **named: Any) -> list[int] | None:
        """The script's reply, or None once Redis has failed (warned once)."""
        if self.failed:
            return None
        if self._beat is None and op != "leave":
            self._beat = asyncio.ensure_future(self._heartbeat())
        args: list[Any] = [op, "engine", self.engine, "lease_ms", self.lease_ms]
        args += ["want_ms", C.CONCURRENCY_WANT_MS]
        for k, v in named.items():
            args += [k, v]
        try:
            return [int(x) for x in await self._script(keys=self._keys, args=args)]
        except (rx.RedisError, OSError) as exc:
            self.failed = True
            log.warning(
                "The shared concurrency limit's Redis failed (%s: %s); this run goes on with "
                "its own limit.",
                type(exc).__name__,
                exc,
            )
            if self._beat is not None:
                self._beat.cancel()  # its lease lapses: the other runs get its slots back
            return None

    async def _heartbeat(self) -> None:
        while not self.failed:
            await asyncio.sleep(self.lease_ms / 3000)
            await self.call("renew")

    async def close(self) -> None:
        if self._beat is not None:  # a cancel inside a Redis call can be lost (cancel.py)
            await cancel_and_wait((self._beat,))
        await self.call("leave")
