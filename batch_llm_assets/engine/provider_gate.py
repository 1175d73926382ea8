"""The provider's own state, from its x-ratelimit-remaining/reset headers, held against this
engine's sends: a send waits while the provider cannot take it yet.

The shared limiter (limiter.lua) paces every process at the configured rate and bursts as far
as the provider's bucket allows. What it cannot model is a provider that does not refill
continuously: a fixed window (or Azure's per-second quantization of a per-minute limit) gives
nothing more until its reset, then all of it; a sliding window frees a burst only a window
after it went. The gate tells the two apart from the headers themselves: a bucket's reset
moves later as it is drawn down, a window's stays put. It then holds a send that the provider
would refuse until the bucket has refilled or the window has reset.

Per engine: sends of other processes after the latest answer are not seen here (the shared
schedule covers those). The engine's tokens are counted as (estimated prompt tokens, fixed
tokens) and weighed at the engine's *current* calibration (`scale`), also those sent before it
was known: a job's first burst goes out at a ratio of 1 and the provider's count can be a third
more, which a count fixed at send time kept for the rest of the window.

`RemainingViews` reads the same headers for the shared schedule: what an engine alone on the
key tells the limiter remains.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from . import _constants as C
from .usage import ProviderLimits

# A pair of answers says something about the provider's kind only when a bucket's reset would
# have moved at least this much between them (header rounding and send jitter are smaller).
_MIN_EVIDENCE_S = 0.05
_VOTES = 4  # evidence saturates here; 2 votes for "window" switch the model
_OPEN_AFTER_RESET_S = 0.01  # a window is waited on until a little after its reset
# A send leaves a sliding window this long after it went (its way to the provider included).
_LEAVES_AFTER_S = 0.05
# Answers whose resets are this close (or a tenth of the window) are of the same window.
_SAME_WINDOW_S = 0.05
_BUDGETS = 31  # a window's latest answers whose median budget is kept
# A request's tokens as the provider counts them can be over the engine's estimate: by a few per
# cent (another tokenizer, characters/4: the calibration is right on average only), and by a few
# tokens of framing the calibration's ratio does not scale (JSON, role markers) on short prompts.
_TOKEN_SLACK = 0.1
_TOKEN_SLACK_ABS = 32
# The refill a bucket's resets show is read once this much was drawn between two answers and
# the reset moved on by at least _REFILL_DRAWN_S (a bucket drawn down, not one near full whose
# refill may have gone to waste): the sends that arrive in another order than they went are
# then a few per cent of it at most.
_REFILL_UNITS = 30
_REFILL_DRAWN_S = 0.3
# The median of this many readings (one per answer) is the refill: a request overtaken on its
# way (64 in flight) answers with its overtakers counted, and one reading was 3-8 % low.
_REFILL_READINGS = 5
# ... and it lowers the configured rate only when it is clearly below it (not header jitter).
_REFILL_BELOW = 0.9


Sent = tuple[float, float]  # (units the scale weighs, units it does not): see `_Dimension.count`


@dataclass(slots=True)
class _Dimension:
    """Requests or tokens: the latest snapshot of the provider's state, and its kind.

    The engine's sends are pairs (scaled, fixed), counted as `scale x scaled + fixed` when used:
    for tokens, (estimated prompt tokens, max_tokens); for requests, (0, requests)."""

    rate_per_s: float  # the limit's refill rate (what the limiter paces at)
    scale: float = 1.0  # the provider's count per scaled unit (the engine's calibration)
    remaining: float = math.inf
    at: float = -math.inf  # time.monotonic() of the send whose answer carried the snapshot
    sent_at: Sent = (0.0, 0.0)  # this engine's sends up to and including that one
    reset_at: float = -math.inf
    window_s: float = 0.0  # the longest reset seen: a window's length
    quota: float = 0.0  # the most remaining seen (a fresh window holds this or `size`)
    votes: int = 0  # > 0: the reset stayed put while the provider was drawn down (a window)
    # A window's latest answers: (remaining, sends up to it), whose median budget is used.
    budgets: deque[tuple[float, Sent]] = field(default_factory=lambda: deque(maxlen=_BUDGETS))
    fresh: float | None = None  # a new window's remaining until its first answer
    start_sent: Sent = (0.0, 0.0)  # this engine's sends before the current window began
    size: float = 0.0  # what a whole window gave this engine
    capacity: float = 0.0  # a bucket's: the most remaining + reset x rate seen
    # A window's answers, as a sliding window sees them: (send time, sends up to it), in send
    # order, over the latest two windows, with what went before the oldest (`log_base`); and
    # the latest answers' (remaining, sends up to it, sends a window before it).
    log: list[tuple[float, Sent]] = field(default_factory=list)
    log_base: Sent = (0.0, 0.0)
    spans: deque[tuple[float, Sent, Sent]] = field(default_factory=lambda: deque(maxlen=_BUDGETS))
    # The earliest send answered (time, reset, sends up to it), for the refill the resets show;
    # not probing once read, or once a 429 came (a rejected send is counted here, not by the
    # provider).
    origin: tuple[float, float, Sent] | None = None
    probing: bool = True
    readings: list[float] = field(default_factory=list)
    refill_per_s: float | None = None  # the refill rate the resets show (a bucket's)

    def _level(self, remaining: float, reset_s: float) -> float:
        """A bucket's remaining with the fraction the header's whole number leaves out.

        The provider floors its level (0.99 requests left shows 0), and on a slow refill the
        fraction is most of a send: a minute's bucket of 285 requests refills one in 0.21 s,
        which the floor cost at the end of every job. The reset tells the rest, `capacity -
        reset x rate`; believed only within the floor's own unit (a wrong rate or a rounded
        reset then changes nothing)."""
        if self.rate_per_s <= 0 or self.votes >= 0:
            return remaining
        self.capacity = max(self.capacity, remaining + reset_s * self.rate_per_s)
        level = self.capacity - reset_s * self.rate_per_s
        return level if remaining <= level < remaining + 1 else remaining

    @property
    def window(self) -> bool:
        return self.votes >= 2 and self.window_s > 0

    def count(self, sent: Sent) -> float:
        return self.scale * sent[0] + sent[1]

    @property
    def budget(self) -> float:
        """What the window gives this engine: remaining + its sends up to the snapshot's. Sends
        the provider took in another order than they went make a few answers' too high (a send
        made before, taken after: in neither) or too low (the other way round), so the median
        of the window's latest answers (older sends' too) is used."""
        if self.budgets:
            return sorted(r + self.count(s) for r, s in self.budgets)[len(self.budgets) // 2]
        if self.fresh is not None:
            return self.fresh + self.count(self.start_sent)
        return math.inf

    def _refill(self, reset_s: float, at: float, sent_at: Sent) -> None:
        """The rate a bucket refills at, from its resets: each unit taken moves the reset on by
        1 / rate, the time between two snapshots moves it back as much. So between the earliest
        answered send and this one, `rate = units sent between / (reset moved + time between)`,
        while the bucket is neither full nor refusing (a non-binding limit's bucket stays near
        full and its refill goes to waste: read there, the rate fell 10 % at each answer).
        Providers that send no x-ratelimit-limit-* (or a wrong one) show their real rate this
        way in a job's first burst, before a limit configured too high meets a 429."""
        if not self.probing or reset_s <= 0:
            return
        if self.origin is None or at < self.origin[0]:
            self.origin = (at, reset_s, sent_at)
            return
        t0, reset0, sent0 = self.origin
        units = self.count(sent_at) - self.count(sent0)
        if units >= _REFILL_UNITS and reset_s - reset0 >= _REFILL_DRAWN_S:
            self.readings.append(units / (reset_s - reset0 + at - t0))
        if len(self.readings) >= _REFILL_READINGS:
            self.refill_per_s = statistics.median(self.readings)
            self.probing = False  # read once: later answers may come from a bucket gone full

    def observe(self, remaining: float, reset_s: float, at: float, sent_at: Sent) -> None:
        self._refill(reset_s, at, sent_at)
        remaining = self._level(remaining, reset_s)
        reset_at = at + reset_s
        same = abs(reset_at - self.reset_at) < max(_SAME_WINDOW_S, 0.1 * self.window_s)
        if not same:
            self.budgets.clear()  # another window's
        self.budgets.append((remaining, sent_at))
        if self.window and same:
            # The provider's clock started on arrival, after `at`: the latest end seen is the
            # closest to the window's (a send on the earliest one arrived before the reset).
            reset_at = max(reset_at, self.reset_at)
            self.reset_at = reset_at
        if self.window:
            self._log(remaining, at, sent_at)
        if at < self.at:
            return  # an answer to an earlier send: its snapshot is older
        dropped = self.remaining - remaining
        if self.at > -math.inf and dropped > 0 and self.rate_per_s > 0:
            expect = (at - self.at) + dropped / self.rate_per_s  # how far a bucket's would move
            # OpenAI writes resets of minutes in whole seconds (`6m0s`): then a reset that
            # stayed put says nothing unless a bucket's would have moved by several seconds.
            coarse = reset_s >= 60 and reset_s == int(reset_s)
            if expect >= max(_MIN_EVIDENCE_S, 4.0 if coarse else 0.0):
                moved = reset_at - self.reset_at
                if abs(moved) < 0.25 * expect:
                    self.votes = min(_VOTES, self.votes + 1)
                elif moved > 0.6 * expect:
                    self.votes = max(-_VOTES, self.votes - 1)
        self.remaining, self.at, self.sent_at, self.reset_at = remaining, at, sent_at, reset_at
        self.window_s = max(self.window_s, reset_s)
        self.quota = max(self.quota, remaining)

    def wait_s(self, cost: float, now: float, sent: Sent) -> float:
        """How long a send of `cost` must wait for the provider to have it; 0: send now."""
        if self.at == -math.inf:
            return 0.0
        need = min(cost, self.quota) if self.quota > 0 else cost
        if self.window:
            if now >= self.reset_at:
                # A new window since the snapshot: its quota, less what went since it began.
                windows = math.floor((now - self.reset_at) / self.window_s) + 1
                self.at = self.reset_at + (windows - 1) * self.window_s
                self.reset_at = self.at + self.window_s
                # What the window gave this engine (its budget less its sends before the
                # window) is its size: the most remaining seen is one request short of it.
                if self.budget < math.inf:
                    self.size = max(self.size, self.budget - self.count(self.start_sent))
                self.remaining = self.fresh = max(self.quota, self.size)
                self.sent_at = self.start_sent = sent
                self.budgets.clear()
            if self.budget - self.count(sent) >= need:
                return 0.0
            return min(self.reset_at - now + _OPEN_AFTER_RESET_S, self._slides_s(need, now, sent))
        if self.rate_per_s <= 0:
            return 0.0
        refilled = self.remaining + self.rate_per_s * max(0.0, now - self.at - C.SNAPSHOT_LAG_S)
        if self.quota > 0:
            refilled = min(refilled, self.quota)  # a bucket holds no more than it showed
        available = refilled - (self.count(sent) - self.count(self.sent_at))
        return 0.0 if available >= need else (need - available) / self.rate_per_s

    def _log(self, remaining: float, at: float, sent_at: Sent) -> None:
        i = bisect.bisect(self.log, at, key=lambda e: e[0])
        self.log.insert(i, (at, sent_at))
        self.spans.append((remaining, sent_at, self._sent_by(at - self.window_s)))
        old = bisect.bisect(self.log, self.log[-1][0] - 2 * self.window_s, key=lambda e: e[0])
        if old:
            self.log_base = self.log[old - 1][1]
            del self.log[:old]

    def _sent_by(self, t: float) -> Sent:
        """This engine's sends up to time `t`, as far as answers show (others: later)."""
        i = bisect.bisect(self.log, t, key=lambda e: e[0])
        return self.log[i - 1][1] if i else self.log_base

    def _slides_s(self, need: float, now: float, sent: Sent) -> float:
        """The wait for `need` if the window slides: a send leaves it a window after it went.

        The window's reset says when *all* of it is free: one late send held everything
        behind it till then (a straggler 2.4 s after a burst cost 2.4 s of a 10 s window).
        Safe for a fixed window too: sends within a window before now include all of the
        current fixed window's, and the capacity is the least of the two readings (a sliding
        reading of a fixed window counts the window before's sends in)."""
        if not self.spans:
            return math.inf
        sliding = statistics.median_low(r + self.count(s) - self.count(b) for r, s, b in self.spans)
        capacity = min(self.budget - self.count(self.start_sent), sliding)
        # The first answered send whose leaving frees enough.
        over = self.count(sent) + need - capacity
        i = bisect.bisect_left(self.log, over, key=lambda e: self.count(e[1]))
        if i == len(self.log):
            return math.inf
        return max(0.0, self.log[i][0] + self.window_s + _LEAVES_AFTER_S - now)


class ProviderGate:
    """Requests and tokens (see the module). `sent` is the engine's counter: [estimated prompt
    tokens, requests, fixed tokens] (the last may be left out: 0)."""

    def __init__(self, *, rpm: int | None, tpm: int | None) -> None:
        self.tokens = _Dimension((tpm or 0) / 60)
        self.requests = _Dimension((rpm or 0) / 60)

    def set_rates(self, *, rpm: int | None, tpm: int | None) -> None:
        self.tokens.rate_per_s = (tpm or 0) / 60
        self.requests.rate_per_s = (rpm or 0) / 60

    def set_scale(self, scale: float) -> None:
        """The provider's tokens per estimated prompt token, as the engine has learnt it."""
        self.tokens.scale = scale

    @staticmethod
    def _split(sent: Sequence[float]) -> tuple[Sent, Sent]:
        return (sent[0], sent[2] if len(sent) > 2 else 0.0), (0.0, sent[1])

    def observe(self, limits: ProviderLimits, at: float, sent: Sequence[float]) -> None:
        """Fold in one answer's x-ratelimit-* for the send made at `at`, when
        this engine had sent `sent` (that send included)."""
        tokens, requests = self._split(sent)
        if limits.remaining_tokens is not None and limits.reset_tokens_s is not None:
            self.tokens.observe(limits.remaining_tokens, limits.reset_tokens_s, at, tokens)
        if limits.remaining_requests is not None and limits.reset_requests_s is not None:
            self.requests.observe(limits.remaining_requests, limits.reset_requests_s, at, requests)

    def wait_s(self, tokens: float, now: float, sent: Sequence[float]) -> float:
        """How long a send of `tokens` (the engine's reservation) must wait; 0: send now."""
        in_tokens, in_requests = self._split(sent)
        return max(
            self.tokens.wait_s(tokens * (1 + _TOKEN_SLACK) + _TOKEN_SLACK_ABS, now, in_tokens),
            self.requests.wait_s(1, now, in_requests),
        )

    def rejected(self) -> None:
        """A 429 came: the sends counted since include one the provider did not take, so the
        resets no longer tell the refill (the limiter's decrease takes over)."""
        for d in (self.tokens, self.requests):
            d.probing = False

    def refill_limits(self, *, rpm: int | None, tpm: int | None) -> dict[str, int]:
        """Per-minute limits the resets show to be clearly below `rpm` / `tpm`: a bucket's
        (a window's reset does not move with what is taken)."""
        lower = {}
        for name, d, limit in (("rpm", self.requests, rpm), ("tpm", self.tokens, tpm)):
            if limit and d.refill_per_s and d.votes < 0 and not d.window:
                per_min = int(d.refill_per_s * 60)
                if per_min < _REFILL_BELOW * limit:
                    lower[name] = per_min
        return lower

    @property
    def window_s(self) -> float:
        """The provider's window when it enforces windows (0: a bucket, or not known)."""
        return max((d.window_s for d in (self.tokens, self.requests) if d.window), default=0.0)


class RemainingViews:
    """The provider's remaining at an answer's snapshot, as the median of the latest answers'.

    The provider counts sends in the order they arrive, not the order this engine counted them (a
    request on a new connection goes out later than one on a reused one): an answer whose request
    was overtaken shows the overtakers gone already, and the engine (`_less_unseen`) takes them off
    again. In a job's first burst that made the schedule's clamp a second or two short on a minute's
    bucket. Each answer's `remaining + sends counted up to it`, refilled at the rate (up to the
    bucket) to this answer's time, is its view; the median of the latest views stands for this
    answer's. For an engine alone on the key only: with others, a view lacks their sends since,
    which only the latest answer shows."""

    def __init__(self) -> None:
        self._tokens: deque[tuple[float, float, float, float]] = deque(maxlen=C.REMAINING_ANSWERS)
        self._requests: deque[tuple[float, float, float, float]] = deque(maxlen=C.REMAINING_ANSWERS)

    def of(
        self,
        limits: ProviderLimits,
        at: float,
        seen: tuple[int, int],
        tpm: int | None,
        rpm: int | None,
        *,
        use: bool = True,
    ) -> ProviderLimits:
        """Record this answer's views; with `use`, the limits with the medians as remaining.

        The reset moves with the remaining, so that remaining + reset x rate, the bucket's
        capacity the limiter learns its burst from, stays what this answer showed: with the
        median's remaining and this answer's own reset, a capacity of 1.06-1.11 s was read off
        a 1 s bucket, and the burst grew past it (a 429 in one run of ten)."""
        tokens = self._median(
            self._tokens, limits.remaining_tokens, limits.reset_tokens_s, at, seen[0], tpm, use
        )
        requests = self._median(
            self._requests,
            limits.remaining_requests,
            limits.reset_requests_s,
            at,
            seen[1],
            rpm,
            use,
        )
        if not use:
            return limits
        return replace(
            limits,
            remaining_tokens=tokens[0],
            reset_tokens_s=tokens[1],
            remaining_requests=requests[0],
            reset_requests_s=requests[1],
        )

    @staticmethod
    def _median(
        views: deque[tuple[float, float, float, float]],
        remaining: int | None,
        reset_s: float | None,
        at: float,
        seen: int,
        per_min: int | None,
        use: bool,
    ) -> tuple[int | None, float | None]:
        """(remaining, reset): the median view, with the reset that keeps this answer's
        capacity."""
        if remaining is None or reset_s is None or not per_min:
            return remaining, reset_s
        rate = per_min / 60
        capacity = remaining + reset_s * rate
        views.append((at, remaining, capacity, seen))
        if not use:
            return remaining, reset_s
        # Views of the same burst only: an older one is refilled over longer, at the rate the
        # engine knows, which may not be the provider's.
        levels = sorted(
            min(full, r + rate * (at - t)) + n
            for t, r, full, n in views
            if abs(at - t) <= C.REMAINING_WITHIN_S
        )
        if len(levels) < 3:
            return remaining, reset_s
        level = max(0, min(math.floor(capacity), math.floor(levels[len(levels) // 2] - seen)))
        return level, max(0.0, (capacity - level) / rate)
