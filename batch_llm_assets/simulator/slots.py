"""A self-hosted server's decode slots: `decode_slots` requests computed at once, the rest queued
inside the server, and the answers of clients that hung up.

- Slots and queue. vLLM runs at most `max_num_seqs` sequences in a batch and llama.cpp's server
  `--parallel` slots; a request beyond them waits inside the server, first come first served,
  and its latency is its wait plus its own decode. `decode_slots` 0: no limit (a hosted API's
  view: every admitted request is computed at once).
- Decode time: `latency_ms + latency_per_token_ms x completion tokens`, the per-token part
  times `1 + decode_slowdown x (batch - 1)`: a larger batch decodes each sequence a little
  slower (continuous batching is memory-bound), while the batch's throughput still grows.
- A client that hangs up (a timeout, a closed connection) while its request is queued or being
  decoded does not stop the work: llama.cpp's server goes on computing a non-streamed request
  whose client is gone (ggml-org/llama.cpp#9273), so its slot stays busy until the answer is
  done and thrown away. Counted at once, as `abandoned_answers`: compute paid, answer lost.

`max_concurrent` is the most requests inside the server at once (queued + decoding),
`max_decoding` the most decoding; GET /stats reports both, and `in_server` now.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from typing import Any


class DecodeSlots:
    """The server's slots; kept across `reset` (requests in flight keep theirs), peaks zeroed."""

    def __init__(self) -> None:
        self.inside = 0  # queued + decoding
        self.busy = 0  # decoding
        self._queue: deque[asyncio.Future[None]] = deque()
        self._work: set[asyncio.Task[None]] = set()
        self.reset()

    def reset(self) -> None:
        self.counts: Counter[str] = Counter()
        self.max_inside = self.inside
        self.max_busy = self.busy

    def stats(self) -> dict[str, Any]:
        return {
            "abandoned_answers": self.counts["abandoned_answers"],
            "max_concurrent": self.max_inside,
            "max_decoding": self.max_busy,
            "in_server": self.inside,
        }

    async def serve(self, config: Any, completion: int, jitter: float) -> None:
        """Queue for a slot and decode (`config` read as each step starts, so a change at run
        time applies to what comes next); CancelledError when the client hung up, the work
        going on without it."""
        work = asyncio.ensure_future(self._serve(config, completion, jitter))
        self._work.add(work)
        work.add_done_callback(self._work.discard)
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            if not work.done():
                self.counts["abandoned_answers"] += 1
            raise

    async def _serve(self, config: Any, completion: int, jitter: float) -> None:
        self.inside += 1
        self.max_inside = max(self.max_inside, self.inside)
        try:
            await self._slot(config().decode_slots)
            try:
                cfg = config()
                self.max_busy = max(self.max_busy, self.busy)
                per_token = cfg.latency_per_token_ms * (1 + cfg.decode_slowdown * (self.busy - 1))
                delay = (cfg.latency_ms + per_token * completion) * jitter / 1000
                if delay > 0:
                    await asyncio.sleep(delay)
            finally:
                self._free(config().decode_slots)
        finally:
            self.inside -= 1

    async def _slot(self, slots: int) -> None:
        """A slot now, or a place in the queue; a freed slot passes to the queue's head."""
        if slots and (self.busy >= slots or self._queue):
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._queue.append(turn)
            await turn  # the slot was handed over: busy already counts it
            return
        self.busy += 1

    def _free(self, slots: int) -> None:
        while self._queue and (not slots or self.busy <= slots):
            turn = self._queue.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.busy -= 1
