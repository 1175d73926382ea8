"""Request merge policies: which request queues the next n messages are claimed from.

`pick(n, ready)` names a queue per message (fewer when the queues hold fewer), among the ready
ones (those not found empty in this poll); the worker claims them and asks again for what an
empty queue could not give.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from typing import Protocol

from .settings import Lane


class MergePolicy(Protocol):
    async def pick(self, n: int, ready: Sequence[Lane]) -> list[Lane]: ...


class RandomRobin:
    """llm-d's `random-robin`: the queues in a random order, round after round. (llm-d selects
    at random among the queues that have a message: 1/N each in expectation; a shuffled round
    keeps each queue within one message of it.)"""

    def __init__(self) -> None:
        self._round: list[Lane] = []

    async def pick(self, n: int, ready: Sequence[Lane]) -> list[Lane]:
        out: list[Lane] = []
        while len(out) < n:
            if not self._round:
                self._round = random.sample(list(ready), len(ready))
            lane = self._round.pop()
            if lane in ready:
                out.append(lane)
        return out


class Weighted:
    """`weighted`: shares by the queues' weights, interleaved (smooth weighted round robin:
    each pick credits every queue its weight and takes the most credited, debited the total)."""

    def __init__(self) -> None:
        self._credit: dict[int, float] = {}

    async def pick(self, n: int, ready: Sequence[Lane]) -> list[Lane]:
        total = sum(lane.spec.weight for lane in ready)
        out: list[Lane] = []
        for _ in range(n):
            for lane in ready:
                self._credit[id(lane)] = self._credit.get(id(lane), 0.0) + lane.spec.weight
            best = max(ready, key=lambda lane: self._credit[id(lane)])
            self._credit[id(best)] -= total
            out.append(best)
        return out


class DeadlineFirst:
    """`deadline-first`: the n earliest deadlines at the heads of all the queues."""

    async def pick(self, n: int, ready: Sequence[Lane]) -> list[Lane]:
        heads = [(d, i) for i, lane in enumerate(ready) for d in await lane.heads(n)]
        return [ready[i] for _, i in heapq.nsmallest(n, heads)]


POLICIES = {"random-robin": RandomRobin, "weighted": Weighted, "deadline-first": DeadlineFirst}
