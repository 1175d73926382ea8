"""How the simulator enforces a per-minute limit, the ways real providers do.

- `bucket`: a token bucket refilled continuously at limit/60 per second holding `bucket_s`
  seconds of the limit (Anthropic documents a bucket "continuously replenished up to your
  maximum limit", a minute's worth; OpenAI's reset headers behave alike; 0.1-60 s here).
- `fixed_window`: limit x window/60 per window of `window_s`, reset at the window's edge (the
  fixed windows of API gateways).
- `sliding_window`: at most limit x window/60 within any `window_s` seconds (a gateway's
  sliding log).
- `quantized`: a per-minute limit enforced over a short period (Azure OpenAI "evaluates the rate
  of incoming requests over a small period of time, typically 1 or 10 seconds"): a fixed window
  of `quantum_s` holding limit x quantum/60.
- `azure`: the same over 1 s and 10 s at once (both must admit). The 10 s period binds where
  the 1 s one cannot: a request larger than a second's share (tokens, or a share under one
  request) is admitted into an empty second, and the 10 s period holds those to its share.

Each answers `wait_for(cost, now)` (0 if it can take the cost now), `take`, and the state a
provider reports: `remaining`, `reset_s` and `capacity`.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

ENFORCEMENTS = ("bucket", "fixed_window", "sliding_window", "quantized", "azure")
AZURE_PERIODS_S = (1.0, 10.0)


class Limit(Protocol):
    per_min: int
    capacity: float

    def wait_for(self, cost: float, now: float) -> float: ...

    def take(self, cost: float, now: float) -> None: ...

    def remaining(self, now: float) -> int: ...

    def reset_s(self, now: float) -> float: ...


class TokenBucket:
    """Refilled continuously; a cost above the whole bucket is admitted when it is full (owed)."""

    def __init__(self, per_min: int, bucket_s: float, now: float) -> None:
        self.per_min = per_min
        self.rate = per_min / 60.0
        self.capacity = max(1.0, self.rate * bucket_s)
        self.level = self.capacity
        self.last = now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + max(0.0, now - self.last) * self.rate)
        self.last = now

    def wait_for(self, cost: float, now: float) -> float:
        self._refill(now)
        need = min(cost, self.capacity)
        return 0.0 if need <= self.level else (need - self.level) / self.rate

    def take(self, cost: float, now: float) -> None:
        self._refill(now)
        self.level -= cost

    def remaining(self, now: float) -> int:
        self._refill(now)
        return max(0, int(self.level))

    def reset_s(self, now: float) -> float:
        self._refill(now)
        return (self.capacity - self.level) / self.rate


class FixedWindow:
    """limit x window/60 per window; windows start at `origin` and follow each other."""

    def __init__(self, per_min: int, window_s: float, now: float) -> None:
        self.per_min = per_min
        self.window_s = window_s
        self.capacity = max(1.0, per_min * window_s / 60.0)
        self.origin = now
        self.index = 0
        self.used = 0.0

    def _roll(self, now: float) -> None:
        index = math.floor((now - self.origin) / self.window_s)
        if index != self.index:
            self.index, self.used = index, 0.0

    def _end(self) -> float:
        return self.origin + (self.index + 1) * self.window_s

    def wait_for(self, cost: float, now: float) -> float:
        self._roll(now)
        # A cost above the whole window is admitted into an empty window.
        if self.used + min(cost, self.capacity) <= self.capacity:
            return 0.0
        return max(1e-3, self._end() - now)

    def take(self, cost: float, now: float) -> None:
        self._roll(now)
        self.used += cost

    def remaining(self, now: float) -> int:
        self._roll(now)
        return max(0, int(self.capacity - self.used))

    def reset_s(self, now: float) -> float:
        self._roll(now)
        return self._end() - now if self.used else 0.0


class SlidingWindow:
    """At most limit x window/60 within any `window_s` seconds (a log of what was admitted)."""

    def __init__(self, per_min: int, window_s: float, now: float) -> None:
        self.per_min = per_min
        self.window_s = window_s
        self.capacity = max(1.0, per_min * window_s / 60.0)
        self.log: deque[tuple[float, float]] = deque()
        self.used = 0.0

    def _expire(self, now: float) -> None:
        while self.log and self.log[0][0] <= now - self.window_s:
            self.used -= self.log.popleft()[1]

    def wait_for(self, cost: float, now: float) -> float:
        self._expire(now)
        need = min(cost, self.capacity)
        if self.used + need <= self.capacity:
            return 0.0
        freed = self.used
        for t, c in self.log:  # the earliest time enough has left the window
            freed -= c
            if freed + need <= self.capacity:
                return max(1e-3, t + self.window_s - now)
        return self.window_s

    def take(self, cost: float, now: float) -> None:
        self._expire(now)
        self.log.append((now, cost))
        self.used += cost

    def remaining(self, now: float) -> int:
        self._expire(now)
        return max(0, int(self.capacity - self.used))

    def reset_s(self, now: float) -> float:
        self._expire(now)
        return self.log[-1][0] + self.window_s - now if self.log else 0.0


class AllOf:
    """Several limits on one quantity: admitted when each admits; reports the one that binds."""

    def __init__(self, parts: list[Limit]) -> None:
        self.parts = parts
        self.per_min = parts[0].per_min
        self.capacity = min(p.capacity for p in parts)

    def wait_for(self, cost: float, now: float) -> float:
        return max(p.wait_for(cost, now) for p in self.parts)

    def take(self, cost: float, now: float) -> None:
        for p in self.parts:
            p.take(cost, now)

    def _binding(self, now: float) -> Limit:
        return min(self.parts, key=lambda p: (p.remaining(now), -p.reset_s(now)))

    def remaining(self, now: float) -> int:
        return self._binding(now).remaining(now)

    def reset_s(self, now: float) -> float:
        return self._binding(now).reset_s(now)


def make_limit(
    per_min: int,
    *,
    enforcement: str,
    bucket_s: float = 1.0,
    window_s: float = 10.0,
    quantum_s: float = 1.0,
    now: float,
) -> Limit:
    if enforcement == "bucket":
        return TokenBucket(per_min, bucket_s, now)
    if enforcement == "fixed_window":
        return FixedWindow(per_min, window_s, now)
    if enforcement == "sliding_window":
        return SlidingWindow(per_min, window_s, now)
    if enforcement == "quantized":
        return FixedWindow(per_min, quantum_s, now)
    if enforcement == "azure":
        return AllOf([FixedWindow(per_min, period, now) for period in AZURE_PERIODS_S])
    raise ValueError(f"unknown enforcement {enforcement!r}; expected one of {ENFORCEMENTS}")
