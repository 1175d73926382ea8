"""What the simulator counted: GET /stats.

Counters by event, admissions and 429s per second, and the admission log: each admitted
request's time (epoch seconds) and its tokens as the provider counted them (prompt as counted,
plus max_tokens), so a benchmark can compute, after a run, what was admitted in any 60 s
window. GET /stats?log=1 includes the log; it keeps the latest ADMISSION_LOG_MAX admissions
(`log_dropped` says how many older ones it let go), so a simulator left running stays small.
GET /stats?messages=1 includes the messages of the latest RECENT_MAX chat requests (each content
cut at RECENT_CHARS), for a test to read what a client said (a repair turn, a system prompt).
`headers` counts the values of RECORDED_HEADERS received ("name: value" -> requests), for a test
to check what reached which gateway (llm-d's inference objective).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from typing import Any

ADMISSION_LOG_MAX = 250_000
RECENT_MAX = 64
RECENT_CHARS = 8_000
RECORDED_HEADERS = ("x-gateway-inference-objective",)


class Stats:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.per_second: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
        self.prompts: Counter[str] = Counter()
        self.flex_asks: Counter[str] = Counter()  # prompt digest -> requests at flex (tiers.py)
        self.admissions: deque[tuple[float, int]] = deque(maxlen=ADMISSION_LOG_MAX)
        self.started_at = time.time()  # when the limits were last set (windows start here)
        self.first_received_at: float | None = None
        self.recent: deque[list[dict[str, Any]]] = deque(maxlen=RECENT_MAX)
        self.headers: Counter[str] = Counter()

    def saw_headers(self, headers: Any) -> None:
        for name in RECORDED_HEADERS:
            if (value := headers.get(name)) is not None:
                self.headers[f"{name}: {value}"[:RECENT_CHARS]] += 1

    def heard(self, messages: list[Any]) -> None:
        """Keep a chat request's messages (roles and text, cut) among the latest RECENT_MAX."""
        self.recent.append(
            [
                {"role": m.get("role"), "content": str(m.get("content"))[:RECENT_CHARS]}
                for m in messages
                if isinstance(m, dict)
            ]
        )

    def received(self) -> None:
        self.counts["received"] += 1
        if self.first_received_at is None:
            self.first_received_at = time.time()

    def admitted(self, tokens: int) -> None:
        now = time.time()
        self.counts["admitted_requests"] += 1
        self.counts["admitted_tokens"] += tokens
        second = self.per_second[int(now)]
        second[0] += 1
        second[1] += tokens
        self.admissions.append((now, tokens))

    def rate_limited(self) -> None:
        self.counts["rate_limited"] += 1
        self.per_second[int(time.time())][2] += 1

    def body(self, config: dict[str, Any], *, log: bool, messages: bool = False) -> dict[str, Any]:
        series = [
            {"t": t, "requests": v[0], "tokens": v[1], "rate_limited": v[2]}
            for t, v in sorted(self.per_second.items())
        ]
        body = {
            **self.counts,
            "config": config,
            "series": series,
            "distinct_prompts": len(self.prompts),
            "resent_prompts": sum(n - 1 for n in self.prompts.values() if n > 1),
            "started_at": self.started_at,
            "first_received_at": self.first_received_at,
            "log_dropped": self.counts["admitted_requests"] - len(self.admissions),
            "headers": dict(self.headers),
        }
        if log:
            body["admissions"] = [[round(t, 6), n] for t, n in self.admissions]
        if messages:
            body["recent_messages"] = list(self.recent)
        return body
