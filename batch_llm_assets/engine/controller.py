"""What the provider's answers say, for one engine: the limits it states, whether it enforces a
bucket or a window, what remains of it less what this engine sent since, and how many prompt
tokens it counts per estimated one.

Everything here is read from the provider's own numbers (x-ratelimit-* headers and usage), not
from timing: a busy host makes the engine slower, never changes what it believes.
The limiter (limiter.lua) gets the result in `settle`.

Provider documents behind it: OpenAI's x-ratelimit-limit/remaining/reset-{requests,tokens},
the reset being "the time until the rate limit resets to its initial state"
(platform.openai.com/docs/guides/rate-limits); Anthropic's limits are a token bucket
"continuously replenished up to your maximum limit" (docs.anthropic.com/en/api/rate-limits);
Azure OpenAI "evaluates the rate of incoming requests over a small period of time, typically
1 or 10 seconds" (learn.microsoft.com/azure/ai-services/openai/how-to/quota): a window.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from . import _constants as C
from .limiter import RedisLimiter
from .usage import ProviderLimits

# When a request went (time.monotonic()), and what this engine had sent by then: requests, its
# prompt tokens as estimated, and its answer budgets.
Mark = tuple[float, float, float, float]


@dataclass(slots=True)
class _Dim:
    """Requests or tokens: the provider's kind (bucket or window) and its latest state."""

    bucket: bool = False  # its reset grew as it was drawn down: its capacity is real
    window: bool = False  # a draw saw its reset count down: for the engine's life
    # (remaining, reset, when that reset falls: the answer's arrival + reset) of an earlier answer
    anchor: tuple[float, float, float] | None = None
    sighted: float | None = None  # when the reset of a first answer that read as a bucket falls
    reset_max: float = 0.0  # the longest reset seen: a window is at least that long
    capacity: bool = False  # a window whose x-ratelimit-limit is its quota: for the engine's life

    def vote(
        self,
        remaining: float,
        reset_s: float,
        per_s: float,
        drawn: float,
        *,
        sent: float,
        now: float,
    ) -> None:
        """A bucket's reset is when it is full again: drawn down by X, it grows by the time the
        rate takes to refill X. A fixed window's counts down to its end, as fast as time, and
        paced sends draw it about as fast. A sliding window's (its length after the last send)
        does neither: it is paced as a bucket, with no burst learned. Read from the provider's
        own numbers, over a draw of at least WINDOW_EVIDENCE_S of the rate within one period:
        no timing of ours, so a busy host cannot fake either. `drawn`: what this engine had sent
        by the answered request (all that was drawn, if it is alone on the key); `sent`, `now`:
        when it was sent and when its answer came (time.monotonic()). A request sent after an
        earlier answer's reset fell was admitted in a later period than that answer."""
        a = self.anchor
        ends = now + reset_s  # the latest this answer's period ends
        # A bucket that holds this much is full again this soon, no later than it takes to
        # refill what this engine drew. So is a fixed window read late in its period (its reset
        # is its end, however little was drawn): seen on the first answer, it is a bucket only
        # if the first answer sent after that reset reads so too (a window's next period starts
        # its reset over). A sliding window's reset is its length.
        seen = reset_s <= min(remaining / per_s / 2, drawn / per_s + C.WINDOW_RESET_MARGIN_S)
        if self.sighted is not None and sent >= self.sighted:
            self.bucket = self.bucket or seen
            self.sighted = None
        elif a is None and seen:
            self.sighted = ends
        if a is None or remaining > a[0] or sent >= a[2]:
            # Compared with a reading of an earlier period, a window's next one whose reset
            # starts over reads as a bucket's reset growing.
            self.anchor = (remaining, reset_s, ends)
            return
        drawn_s = (a[0] - remaining) / per_s
        if drawn_s < C.WINDOW_EVIDENCE_S:
            return
        if reset_s - a[1] >= drawn_s / 2:
            self.bucket = True
        elif a[1] - reset_s >= drawn_s / 2:
            self.window = True
        self.anchor = (remaining, reset_s, ends)


class Controller:
    """One engine's view of the provider, fed by every answer, read before every send."""

    def __init__(self, limiter: RedisLimiter) -> None:
        self.limiter = limiter
        self._sent = (0.0, 0.0, 0.0)  # requests, estimated prompt tokens, answer budgets sent
        self._dims = (_Dim(), _Dim())
        # Provider's prompt tokens per estimated one, learned from usage (a provider that counts
        # otherwise, characters/4 or another tokenizer, is reserved what it will charge).
        self.calibration = 1.0
        self._sums = [0.0, 0.0]  # provider's prompt tokens, estimated ones (fading)

    def on_send(self, prompt: int, max_tokens: int) -> Mark:
        r, p, m = self._sent
        self._sent = (r + 1, p + prompt, m + max_tokens)
        return (time.monotonic(), *self._sent)

    def _since(self, mark: Mark | tuple[float, ...], i: int) -> float:
        """Requests (i = 0) or tokens (1) this engine sent after `mark`, tokens as the provider
        counts them: at the calibration learnt by now, also for sends made before it was (a
        job's first burst goes out at a ratio of 1 and the provider's count can be a third
        more: counted at the ratio of the send, the debt would be a third short)."""
        r, p, m = self._sent
        if i == 0:
            return r - mark[1]
        return self.calibration * (p - mark[2]) + (m - mark[3])

    def _drawn(self, mark: Mark, i: int) -> float:
        """Requests (i = 0) or tokens (1) this engine had sent by `mark`, as the provider counts."""
        return self._since((0.0, 0.0, 0.0, 0.0), i) - self._since(mark, i)

    def reservation(self, estimate: int, max_tokens: int) -> int:
        """The prompt estimate scaled to the provider's own count, plus the answer budget."""
        if self.calibration == 1.0:
            return estimate
        reserve = math.ceil((estimate - max_tokens) * self.calibration) + max_tokens
        return min(reserve, self.limiter.max_request_tokens or reserve)

    def calibrate(self, estimate: int, max_tokens: int, usage_prompt: int) -> None:
        """The ratio of the sums over the latest answers, so one odd prompt moves it little."""
        prompt = estimate - max_tokens
        if prompt <= 0 or usage_prompt <= 0:
            return
        keep = 1 - 1 / C.CALIBRATION_ANSWERS
        self._sums[0] = self._sums[0] * keep + usage_prompt
        self._sums[1] = self._sums[1] * keep + prompt
        ratio = self._sums[0] / self._sums[1]
        self.calibration = min(C.CALIBRATION_MAX, max(C.CALIBRATION_MIN, ratio))

    def observe(self, limits: ProviderLimits, mark: Mark) -> dict[str, float]:
        """What the limiter's `settle` is told of one answer's headers (see limiter.lua)."""
        out: dict[str, float] = {}
        caps: list[float] = []
        unknown = False  # a dimension that reports but is not known a bucket: no wider burst
        now = time.monotonic()
        lim = self.limiter
        dims = (
            ("r", lim.rpm, lim.settings.rpm, limits.remaining_requests, limits.reset_requests_s),
            ("t", lim.tpm, lim.settings.tpm, limits.remaining_tokens, limits.reset_tokens_s),
        )
        for i, (name, rate, configured, remaining, reset_s) in enumerate(dims):
            if not rate or remaining is None:
                continue
            d = self._dims[i]
            if reset_s is not None:
                # At the configured rate: the believed one may have been lowered by a header
                # that states a window's quota, and at half its rate a 30 s window of 300
                # requests, seen at its start, reads as a bucket at sight.
                per_s = (configured or rate) / 60
                d.vote(remaining, reset_s, per_s, self._drawn(mark, i), sent=mark[0], now=now)
                d.reset_max = max(d.reset_max, reset_s)
            # What went after this request is not in its remaining yet.
            out[f"rem_{name}"] = remaining - self._since(mark, i)
            # A window: what it has left holds every process's grants until its reset (the
            # limiter), and it is paced (a burst on top of the pace would spill into its end).
            # A bucket holds remaining + reset x rate: that many seconds of the believed rate
            # is the widest burst. Not of the rate times the factor: a slowdown paces the sends,
            # it does not widen the bucket (counted so, each cut after a 429 widened the burst
            # and shrank its margin in tokens, and the next burst overran the bucket again).
            # As a tolerance on the slowed schedule it admits the factor times the bucket.
            if d.window and reset_s is not None:
                # Counted from the answer's arrival: a provider that writes its headers as it
                # answers (not as it admits) ends the window later than the send + reset.
                out[f"reset_{name}"] = (reset_s + C.WINDOW_RESET_MARGIN_S) * 1000
            elif reset_s is not None and d.bucket:
                caps.append(remaining / (rate / 60) + reset_s)
            else:
                unknown = True
        if any(d.window for d in self._dims):
            out["cap_ms"] = 0.0  # the default burst
        elif caps and not unknown:
            out["cap_ms"] = (min(caps) - C.LEARNED_BURST_MARGIN_S) * 1000
        if self._believe(limits):
            out["restart"] = 1
        return out

    def _believe(self, limits: ProviderLimits) -> bool:
        """x-ratelimit-limit-* as a per-minute limit (OpenAI's and Anthropic's are), unless it
        reads as a capacity. Far under the configured limit, it is ignored. A window with more
        left than a per-minute limit leaves over its longest reset (a window's reset counts its
        length at most) states its quota, as API gateways do (the IETF RateLimit-Limit draft:
        the quota of its window): from then on the configured rate stands, and the window's
        own remaining holds the grants (limiter.lua). A bucket's reset is the time to refill
        what was drawn, not a period: a bucket is not read so."""
        lim = self.limiter
        stated: list[int | None] = []
        for d, configured, limit, remaining in zip(
            self._dims,
            (lim.settings.rpm, lim.settings.tpm),
            (limits.limit_requests, limits.limit_tokens),
            (limits.remaining_requests, limits.remaining_tokens),
            strict=True,
        ):
            if not (configured and limit and limit >= C.PER_MINUTE_LIMIT_FRACTION * configured):
                stated.append(None)
                continue
            per_window = limit * d.reset_max / 60 * C.CAPACITY_READING_MARGIN
            d.capacity = d.capacity or (
                d.window and remaining is not None and remaining > per_window
            )
            stated.append(configured if d.capacity else limit)
        return any(s is not None for s in stated) and lim.believe(rpm=stated[0], tpm=stated[1])
