"""Spend caps: the most one run, and one job in one UTC day, may spend on requests.

Before an attempt is sent, its worst case (the prompt estimate at the input price plus the
answer budget, max_tokens, at the output price) is held against every cap; on the answer its real
cost (from the usage) replaces the hold. An HTTP error is not billed: its hold is released. An
attempt whose answer never came (a timeout, a dropped connection) or came without usage counts at
its worst case: the provider may have billed it. A request that does not fit waits while this
engine has holds in flight (their answers usually cost less than held); when none is left and it
still does not fit, the cap is exhausted: no further request is sent, each fails
`budget_exhausted` (not `ok`, so a rerun sends it, and only it).

The per-run cap is a counter in this process (`RunLedger`; the LLMResource keeps one per Dagster
run). The per-day cap is a hash per job_key and UTC day in the limiter's Redis (`DailyLedger`,
budget.lua): one atomic call reserves, one settles. A hold there carries a lease (its attempt's
timeout plus BUDGET_HOLD_MARGIN_S): when a process dies between the two (SIGKILL), any later call
gives its holds back once their leases end, so a crash keeps at most one worst case per request
then in flight out of the day's cap, and only until the lease ends. A day's keys expire
BUDGET_KEEP_DAYS after it. A batch file is held whole, charged at its worst case once it is
submitted, and refunded to its real cost when it is collected (`tag`: the file's intent id).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from importlib import resources
from typing import Any, Protocol

from . import _constants as C
from .errors import LimiterError
from .redis_client import call_script, check_redis, connect_redis, safe_url
from .transport import ChatResponse

log = logging.getLogger(__name__)

BUDGET_EXHAUSTED = "budget_exhausted"
_SCRIPT = resources.files(__package__).joinpath("budget.lua").read_text()
_NANO = 1_000_000_000  # amounts are integers of 1e-9 USD: exact sums, in Redis too

# (prompt tokens, completion tokens, cached=prompt tokens billed cached) -> USD, or None
Cost = Callable[..., float | None]


def nano(usd: float) -> int:
    return math.ceil(usd * _NANO)


def usd(amount: int) -> float:
    return amount / _NANO


def check_budget(name: str, value: Any) -> float | None:
    """A cap as set: None, or a finite number of USD in (0, MAX_BUDGET_USD]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number of USD, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or not 0 < value <= C.MAX_BUDGET_USD:
        raise ValueError(
            f"{name} must be a finite number of USD above 0 and at most {C.MAX_BUDGET_USD:,} "
            f"(None: no cap), got {value!r}"
        )
    return float(value)


class Ledger(Protocol):
    name: str
    spent_key: str
    cap: int
    spent: int
    held: int

    async def reserve(self, amount: int, lease_ms: int) -> str | None: ...
    async def settle(self, hold: str | None, real: int, tag: str | None = None) -> None: ...
    async def refund(self, tag: str, real: int, day: date) -> bool: ...
    def scope(self) -> str: ...


class RunLedger:
    """`budget_usd`: what this run spent and holds, in this process."""

    name = "budget_usd"
    spent_key = "budget_spent_usd"

    def __init__(self, cap_usd: float) -> None:
        self.cap = nano(cap_usd)
        self.spent = self.held = 0
        self._holds: dict[str, int] = {}
        self._charged: dict[str, int] = {}  # batch files this run submitted -> their charge

    async def reserve(self, amount: int, lease_ms: int) -> str | None:
        if self.spent + self.held + amount > self.cap:
            return None
        hold = uuid.uuid4().hex
        self._holds[hold] = amount
        self.held += amount
        return hold

    async def settle(self, hold: str | None, real: int, tag: str | None = None) -> None:
        self.held -= self._holds.pop(hold, 0) if hold else 0
        if tag is not None:
            if tag in self._charged:
                return
            self._charged[tag] = real
        self.spent += real

    async def refund(self, tag: str, real: int, day: date) -> bool:
        charged = self._charged.pop(tag, None)  # a file of another run: not counted here
        if charged is not None:
            self.spent += real - charged
        return True

    def scope(self) -> str:
        return "of this run"


def day_keys(job: str, day: date) -> list[str]:
    """The day's hash and holds keys of `job` (hashed: any text is a safe key; the hash tag keeps
    both in one Redis Cluster slot)."""
    digest = hashlib.sha256(job.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    base = f"bla:{{budget:{digest}:{day.isoformat()}}}"
    return [base, f"{base}:holds"]


class DailyLedger:
    """`budget_usd_per_day`: what every run of `job` spent and holds in one UTC day, in Redis."""

    name = "budget_usd_per_day"
    spent_key = "budget_spent_today_usd"

    def __init__(self, url: str, *, cap_usd: float, job: str) -> None:
        self.cap = nano(cap_usd)
        self.spent = self.held = 0
        self.job = job
        self.day = datetime.now(UTC).date()
        self._url = url
        self._where = safe_url(url)
        self._client: Any = None
        self._script: Any = None
        self._days: dict[str, date] = {}  # hold -> the day it was taken on

    async def open(self) -> None:
        self._client = connect_redis(self._url)
        self._script = self._client.register_script(_SCRIPT)
        await check_redis(self._client, self._url)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _call(self, op: str, day: date, **named: Any) -> int:
        ends = datetime.combine(day, time(), UTC) + timedelta(days=1 + C.BUDGET_KEEP_DAYS)
        args: list[Any] = [op, "expire_at", int(ends.timestamp())]
        for k, v in named.items():
            args += [k, v]
        done, spent, held = await call_script(
            self._script,
            keys=day_keys(self.job, day),
            args=args,
            where=self._where,
            doing=f"running the daily budget's {op}",
            outage_s=C.LIMITER_OUTAGE_S,
        )
        if day == self.day:
            self.spent, self.held = int(spent), int(held)
        return int(done)

    async def reserve(self, amount: int, lease_ms: int) -> str | None:
        self.day = datetime.now(UTC).date()
        hold = uuid.uuid4().hex
        done = await self._call(
            "reserve", self.day, hold=hold, amount=amount, cap=self.cap, lease_ms=lease_ms
        )
        if not done:
            return None
        self._days[hold] = self.day
        return hold

    async def settle(self, hold: str | None, real: int, tag: str | None = None) -> None:
        day = (self._days.pop(hold, None) if hold else None) or datetime.now(UTC).date()
        await self._call("settle", day, hold=hold or "", real=real, **({"tag": tag} if tag else {}))

    async def refund(self, tag: str, real: int, day: date) -> bool:
        """The file's real cost for its charge on `day`; False when none was found there."""
        return bool(await self._call("refund", day, tag=tag, real=real))

    def scope(self) -> str:
        return f"of job_key {self.job!r} on {self.day.isoformat()} (UTC, all its runs together)"


@dataclass(frozen=True, slots=True)
class Refused:
    """A request not sent: the row's error class and message."""

    error_class: str
    message: str


@dataclass(slots=True)
class Hold:
    worst: int  # 1e-9 USD
    holds: list[str | None] = field(default_factory=list)  # one per ledger


@dataclass(frozen=True)
class SpendReport:
    """What a run's caps say at its end: the reason sending stopped, if it did, and the figures
    (`run/...` metadata): each cap and what was spent against it."""

    exhausted: str | None
    figures: dict[str, float]


def money(value: float) -> str:
    return "$" + f"{value:,.6f}".rstrip("0").rstrip(".")


class SpendCap:
    """The caps a run's requests are held against (see the module): `ledgers` in order, the
    per-run one first (no round trip when it refuses), `cost` the price of a request."""

    def __init__(self, ledgers: Sequence[Ledger], cost: Cost) -> None:
        self.ledgers = list(ledgers)
        self.cost = cost
        self.in_flight = 0
        self.exhausted: Refused | None = None
        self.why: str | None = None  # why sending stopped, once it did
        self._changed = asyncio.Event()  # replaced by a new one whenever a hold settles

    async def open(self) -> SpendCap:
        """Connect to the day's Redis (and authenticate), so a wrong redis_url fails at once."""
        for ledger in self.ledgers:
            if isinstance(ledger, DailyLedger):
                await ledger.open()
        return self

    async def aclose(self) -> None:
        for ledger in self.ledgers:
            if isinstance(ledger, DailyLedger):
                await ledger.aclose()

    def worst(self, prompt: int, completion: int) -> int:
        """The most `prompt` tokens in and `completion` tokens out can cost (1e-9 USD)."""
        return nano(self.cost(prompt, completion, cached=0) or 0.0)

    async def hold(self, estimate: int, max_tokens: int, timeout_s: float) -> Hold | Refused:
        """Hold one attempt's worst case (`estimate`: prompt + max_tokens tokens) for the
        attempt's `timeout_s`, or why it is not sent."""
        amount = self.worst(estimate - max_tokens, max_tokens)
        lease_ms = int((timeout_s + C.BUDGET_HOLD_MARGIN_S) * 1000)
        while self.exhausted is None:
            changed = self._changed
            self.in_flight += 1  # a reserve under way counts: it may hold what frees room
            try:
                got = await self._reserve(amount, lease_ms)
            except LimiterError as exc:
                self._done()
                return Refused(exc.error_class, f"{exc.description}; not sent")
            if isinstance(got, Hold):
                return got
            self.in_flight -= 1
            if self.in_flight == 0:  # nothing of ours can free room: the cap is reached
                self._exhaust(got, amount)
                self._done(0)
            else:
                await changed.wait()
        return self.exhausted

    async def hold_lines(
        self, worst: Sequence[int], *, refunds_due: bool = False
    ) -> tuple[int, Hold | Refused | None]:
        """Hold the longest head of a batch file's lines (`worst`: each line's worst case)
        that fits every cap: (how many lines, the hold), or (0, why none is sent); (0, None)
        when none fits yet but `refunds_due` (files of ours still open) may free room."""
        lease_ms = int(C.BUDGET_FILE_LEASE_S * 1000)
        n = len(worst)
        for _ in range(C.BUDGET_FIT_TRIES):  # a refusal brings the day's figures up to date
            room = min(ledger.cap - ledger.spent - ledger.held for ledger in self.ledgers)
            total = 0
            for i, amount in enumerate(worst[:n]):
                if total + amount > room:
                    n = i
                    break
                total += amount
            if n == 0:
                break
            self.in_flight += 1
            got = await self._reserve(total, lease_ms)
            if isinstance(got, Hold):
                return n, got
            self.in_flight -= 1
        if refunds_due:
            return 0, None
        tightest = min(self.ledgers, key=lambda ledger: ledger.cap - ledger.spent - ledger.held)
        return 0, self._exhaust(tightest, worst[0] if worst else 0)

    async def _reserve(self, amount: int, lease_ms: int) -> Hold | Ledger:
        """A hold on every ledger, or the ledger that refused (the others' holds given back)."""
        hold = Hold(amount)
        for ledger in self.ledgers:
            got = await ledger.reserve(amount, lease_ms)
            if got is None:
                for taken, h in zip(self.ledgers, hold.holds, strict=False):
                    await taken.settle(h, 0)
                return ledger
            hold.holds.append(got)
        return hold

    def _exhaust(self, ledger: Ledger, amount: int) -> Refused:
        held = f", {money(usd(ledger.held))} held by requests in flight" if ledger.held else ""
        day = " (or wait for the next UTC day)" if isinstance(ledger, DailyLedger) else ""
        why = (
            f"the spend cap {ledger.name} = {money(usd(ledger.cap))} {ledger.scope()} is "
            f"reached: {money(usd(ledger.spent))} spent{held}; the next request may cost up to "
            f"{money(usd(amount))}. Raise {ledger.name} on the LLM resource{day} and rerun: "
            f"only the rows recorded {BUDGET_EXHAUSTED} are sent again"
        )
        if self.exhausted is None:
            log.warning("Sending stopped: %s.", why)
            self.why = why
            self.exhausted = Refused(BUDGET_EXHAUSTED, f"not sent: {why}")
        return self.exhausted

    async def settle(self, hold: Hold, resp: ChatResponse | BaseException) -> None:
        """An attempt's end: its real cost replaces its hold (see the module)."""
        real = hold.worst
        if isinstance(resp, ChatResponse) and resp.usage is not None:
            u = resp.usage
            cost = self.cost(
                u.prompt_tokens, u.completion_tokens, cached=u.cached_tokens, tier=resp.service_tier
            )
            real = nano(cost or 0)
        elif (getattr(resp, "status", None) or 0) >= 400:
            real = 0  # an HTTP error answer: not billed
        await self._settle(hold, real)

    async def charge(self, tag: str, amount: int, hold: Hold | None) -> None:
        """A batch file submitted (`tag`: its intent id): charged `amount`, its worst case,
        until it is collected; once, whichever run charges it. Its `hold`, if this run took one,
        is released."""
        if hold is None:
            self.in_flight += 1  # settled below
            hold = Hold(amount, [None] * len(self.ledgers))
        await self._settle(hold, amount, tag)

    async def refund(self, tag: str, real_usd: float, since: date) -> None:
        """A batch file collected: its real cost replaces its charge, on the day it was charged
        (`since` or a later one, up to today); none if it never was (submitted without a cap,
        or its day's keys are gone)."""
        today = datetime.now(UTC).date()
        for ledger in self.ledgers:
            day = max(since, today - timedelta(days=C.BUDGET_KEEP_DAYS))
            try:
                while day <= today and not await ledger.refund(tag, nano(real_usd), day):
                    day += timedelta(days=1)
            except LimiterError as exc:
                log.warning("The daily budget's refund of a batch file failed: %s", exc)

    async def _settle(self, hold: Hold, real: int, tag: str | None = None) -> None:
        try:
            for ledger, h in zip(self.ledgers, hold.holds, strict=True):
                await ledger.settle(h, real, tag)
        except LimiterError as exc:  # the hold lapses at its lease's end
            log.warning("The daily budget could not record a request's cost: %s", exc)
        finally:
            self._done()

    def _done(self, ended: int = 1) -> None:
        """A hold (or a reserve under way) ended: wake the requests waiting for room."""
        self.in_flight -= ended
        self._changed.set()
        self._changed = asyncio.Event()

    def report(self) -> SpendReport:
        figures: dict[str, float] = {}
        for ledger in self.ledgers:
            figures[ledger.name] = usd(ledger.cap)
            figures[ledger.spent_key] = usd(ledger.spent)
        return SpendReport(self.why, figures)
