"""The adaptive concurrency limit of a self-hosted server: how many requests to keep in flight.

A self-hosted server (vLLM, llm-d, llama.cpp, Ollama) sends no rate-limit headers: its limit is
its throughput. It decodes a number of requests at once (vLLM's `max_num_seqs`, llama.cpp's
`--parallel` slots) and queues the rest inside; past that number more requests in flight add
no throughput, only waiting, until answers outlive the client's timeout and are computed for
nobody. The number is unknown to the client and shared with every other run on the server.

The algorithm, a latency gradient in the spirit of TCP Vegas (Brakmo & Peterson, 1995: the
queue one's own traffic builds shows as latency over the no-load latency) as Netflix's
concurrency-limits applies it to a service (VegasLimit: `queue = limit x (1 - rtt_noload /
rtt)`; Gradient2Limit: `limit x gradient`, the gradient clamped to [0.5, 1] and an RTT
tolerance; github.com/Netflix/concurrency-limits): per window of answers (at least
ADAPTIVE_WINDOW_MIN, and as many as the limit; only requests sent after the previous decision
count), `rtt` is their mean latency and `base` the lowest window mean seen (the limit starts at 1
request, so the first is the latency of a request alone). While `rtt <= tolerance x base`
(latency holds, throughput grows with the limit) the limit doubles until it first shrinks (slow
start), then grows by its square root; only when the window used the whole limit (an input that
cannot fill it proves nothing). Past the tolerance requests queue: the limit is multiplied by
the gradient `tolerance x base / rtt` (at least 0.5). It stays within [1, max_concurrency]. Only
answers count (an error's time says nothing of the load). A limit of 1 over the tolerance for
ADAPTIVE_REBASE_WINDOWS windows cannot be its own queue: the rows got slower (longer prompts or
answers), so that latency becomes the base (Envoy's adaptive concurrency filter re-measures its
minRTT the same way when its limit sits at the minimum). The tolerance leaves room for what
continuous batching does: each sequence decodes a little slower in a larger batch while the
batch's throughput still grows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from . import _constants as C


def check_concurrency(value: object, name: str = "max_concurrency") -> int:
    """A whole number >= 1, else a ValueError naming the setting (0, negative, NaN, a bool...)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Limit:
    """The limit's state; shared through Redis when several runs use one server."""

    value: float = float(C.ADAPTIVE_START_LIMIT)
    base_s: float = 0.0  # the no-load latency: the lowest window mean seen (0: none yet)
    growing: bool = True  # slow start: doubles until it first shrinks


def next_limit(
    cur: Limit,
    *,
    rtt_s: float,
    filled: bool,
    max_limit: int,
    rebase: bool = False,
) -> Limit:
    """The limit after one window of answers whose mean latency is `rtt_s` (module doc)."""
    base = rtt_s if rebase or cur.base_s <= 0 else min(cur.base_s, rtt_s)
    tolerated = C.ADAPTIVE_LATENCY_TOLERANCE * base
    if rtt_s <= tolerated:
        if not filled or cur.value >= max_limit:
            return Limit(min(cur.value, float(max_limit)), base, cur.growing)
        grown = cur.value * 2 if cur.growing else cur.value + math.sqrt(cur.value)
        return Limit(min(float(max_limit), grown), base, cur.growing)
    gradient = max(C.ADAPTIVE_MIN_GRADIENT, tolerated / rtt_s)
    return Limit(max(1.0, cur.value * gradient), base, False)


class Window:
    """The answers since the latest decision, to requests sent after it."""

    def __init__(self) -> None:
        self.restart()
        self.low = 0  # consecutive windows at a limit of 1 over the tolerance

    def restart(self) -> None:
        self.since = time.perf_counter()
        self.n = 0
        self.total_s = 0.0
        self.filled = False  # the limit was reached (or a request waited for it)

    def add(self, sent_at: float, latency_s: float) -> bool:
        """Count an answer; False if its request was sent before the window began (it speaks
        of an older limit)."""
        if sent_at < self.since:
            return False
        self.n += 1
        self.total_s += latency_s
        return True

    def full(self, limit: int) -> bool:
        return self.n >= max(C.ADAPTIVE_WINDOW_MIN, limit)

    def decide(self, cur: Limit, max_limit: int) -> Limit:
        """The next limit from this (full) window, and a fresh window."""
        rtt = self.total_s / self.n
        over = rtt > C.ADAPTIVE_LATENCY_TOLERANCE * cur.base_s > 0
        self.low = self.low + 1 if over and cur.value < 2 else 0
        rebase = self.low >= C.ADAPTIVE_REBASE_WINDOWS
        if rebase:
            self.low = 0
        new = next_limit(cur, rtt_s=rtt, filled=self.filled, max_limit=max_limit, rebase=rebase)
        self.restart()
        return new
