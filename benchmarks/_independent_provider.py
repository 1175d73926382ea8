"""An OpenAI-compatible chat server with a provider-style rate limiter, written from the
providers' public documentation only (not from this package's simulator), to check the engine
against a limiter it was not developed beside.

Policies (--policy), each counting requests and, for the token ones, tokens as OpenAI documents
its limiter: the prompt estimated as len(json of messages) / 4, plus max_tokens (or
max_completion_tokens) from the body, charged at admission:

- openai_bucket: a token bucket per dimension (rpm, tpm), capacity one minute's limit, refilled
  continuously; x-ratelimit-limit/remaining/reset-requests and -tokens headers; 429 with
  retry-after-ms and retry-after.
- azure_periods: floor(rpm/60) requests and tpm/60 tokens per fixed 1 s period, and rpm/6,
  tpm/6 per fixed 10 s period; x-ratelimit-remaining-requests/-tokens only (against the
  minute's quota over the trailing 60 s); 429 with retry-after in whole seconds.
- gateway_sliding: a sliding-window log of W s (--window), rpm*W/60 requests (no tokens);
  IETF-draft RateLimit-Limit/-Remaining/-Reset; 429 with Retry-After in whole seconds.
- no_headers_fixed: rpm*W/60 requests per fixed W s window; no rate headers, no Retry-After.
- concurrency_like_vllm: no rate limit; at most --concurrency in flight, the rest queue.

    python benchmarks/_independent_provider.py --policy openai_bucket --rpm 600 --tpm 60000

Binds 127.0.0.1 on a free port (or --port) and prints `PORT <n>` once it listens.
GET /stats: received, admitted, rate_limited, admissions [[unix time, tokens], ...], ...;
POST /reset clears the stats and refills the limiter.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import random
import time
import uuid
from typing import Any

from aiohttp import web

# Latency of an answer: a hosted API's fastest short completion is tens of ms; the jitter keeps
# answers from arriving in lockstep, which no real provider does.
BASE_LATENCY_S = 0.05
JITTER_S = 0.02
# OpenAI's documented estimate: about 4 characters of English per token.
CHARS_PER_TOKEN = 4
# Completion budget charged when a body names no max_tokens: OpenAI then reserves the model's
# maximum; a fixed, deliberately large figure stands in for it.
MISSING_MAX_TOKENS = 4096
# The words of the short answer every request gets (its completion_tokens is their count).
ANSWER = "Noted: markets moved."
# Azure splits a minute's quota into these fixed periods (docs: "evaluated over 1 or 10 s").
AZURE_PERIODS_S = (1.0, 10.0)
# Azure's remaining headers are reported against the minute's quota over this trailing span.
MINUTE_S = 60.0
POLICIES = (
    "openai_bucket",
    "azure_periods",
    "gateway_sliding",
    "no_headers_fixed",
    "concurrency_like_vllm",
)


def request_tokens(body: dict[str, Any]) -> int:
    """Tokens a request is charged at admission: chars/4 of its messages plus its answer budget."""
    prompt = math.ceil(len(json.dumps(body.get("messages", []))) / CHARS_PER_TOKEN)
    budget = body.get("max_completion_tokens", body.get("max_tokens"))
    return prompt + (int(budget) if budget is not None else MISSING_MAX_TOKENS)


def openai_duration(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it: 250ms, 1s, 8.64s, 6m0s, 1m26.4s."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{text}s" if minutes else f"{text}s"


class Refusal(Exception):
    """A request the limiter refuses: 429 with these headers and this error type."""

    def __init__(self, kind: str, wait_s: float | None, headers: dict[str, str]):
        super().__init__(kind)
        self.kind, self.wait_s, self.headers = kind, wait_s, headers


class OpenAIBucket:
    """A continuously refilled bucket per dimension, capacity one minute's limit."""

    def __init__(self, rpm: int, tpm: int | None, start_fill: float):
        self.caps = {"requests": float(rpm)} | ({"tokens": float(tpm)} if tpm else {})
        self.start_fill = start_fill
        self.reset()

    def reset(self) -> None:
        self.level = {k: c * self.start_fill for k, c in self.caps.items()}
        self.at = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        for k, cap in self.caps.items():
            self.level[k] = min(cap, self.level[k] + cap / MINUTE_S * (now - self.at))
        self.at = now

    def _headers(self) -> dict[str, str]:
        out = {}
        for k, cap in self.caps.items():
            out[f"x-ratelimit-limit-{k}"] = str(int(cap))
            out[f"x-ratelimit-remaining-{k}"] = str(max(0, math.floor(self.level[k])))
            full_in = (cap - self.level[k]) / (cap / MINUTE_S)
            out[f"x-ratelimit-reset-{k}"] = openai_duration(full_in)
        return out

    def admit(self, tokens: int) -> dict[str, str]:
        self._refill()
        need = {"requests": 1.0, "tokens": float(tokens)}
        for k, cap in self.caps.items():
            if self.level[k] < need[k]:
                wait = (need[k] - self.level[k]) / (cap / MINUTE_S)
                ms = math.ceil(wait * 1000)
                extra = {"retry-after-ms": str(ms), "retry-after": str(math.ceil(ms / 1000))}
                raise Refusal(k, wait, self._headers() | extra)
        for k in self.caps:
            self.level[k] -= need[k]
        return self._headers()


class AzurePeriods:
    """A minute's quota enforced per fixed 1 s and 10 s period, for requests and tokens."""

    def __init__(self, rpm: int, tpm: int | None):
        self.rpm, self.tpm = rpm, tpm
        self.reset()

    def reset(self) -> None:
        self.counts: dict[tuple[float, int], list[float]] = {}
        self.log: collections.deque[tuple[float, int]] = collections.deque()

    def _limits(self, period: float) -> tuple[float, float | None]:
        share = period / MINUTE_S
        return math.floor(self.rpm * share), (self.tpm * share if self.tpm else None)

    def _headers(self, now: float) -> dict[str, str]:
        while self.log and self.log[0][0] <= now - MINUTE_S:
            self.log.popleft()
        out = {"x-ratelimit-remaining-requests": str(max(0, self.rpm - len(self.log)))}
        if self.tpm:
            used = sum(t for _, t in self.log)
            out["x-ratelimit-remaining-tokens"] = str(max(0, self.tpm - used))
        return out

    def admit(self, tokens: int) -> dict[str, str]:
        now = time.time()
        slots = []
        for period in AZURE_PERIODS_S:
            index = math.floor(now / period)
            used = self.counts.setdefault((period, index), [0.0, 0.0])
            max_reqs, max_tokens = self._limits(period)
            kind = "requests" if used[0] + 1 > max_reqs else None
            if kind is None and max_tokens is not None and used[1] + tokens > max_tokens:
                kind = "tokens"
            if kind:
                wait = (index + 1) * period - now
                retry = {"retry-after": str(max(1, math.ceil(wait)))}
                raise Refusal(kind, wait, self._headers(now) | retry)
            slots.append(used)
        for used in slots:
            used[0] += 1
            used[1] += tokens
        self.counts = {k: v for k, v in self.counts.items() if k[1] >= math.floor(now / k[0])}
        self.log.append((now, tokens))
        return self._headers(now)


class GatewaySliding:
    """A sliding-window log: at most rpm*W/60 requests in any trailing W s."""

    def __init__(self, rpm: int, window_s: float):
        self.window_s, self.limit = window_s, max(1, math.floor(rpm * window_s / MINUTE_S))
        self.reset()

    def reset(self) -> None:
        self.log: collections.deque[float] = collections.deque()

    def admit(self, tokens: int) -> dict[str, str]:
        now = time.monotonic()
        while self.log and self.log[0] <= now - self.window_s:
            self.log.popleft()
        free_at = self.log[0] + self.window_s - now if self.log else 0.0
        head = {"RateLimit-Limit": str(self.limit), "RateLimit-Reset": str(math.ceil(free_at))}
        if len(self.log) >= self.limit:
            retry = {"Retry-After": str(max(1, math.ceil(free_at)))}
            raise Refusal("requests", free_at, head | {"RateLimit-Remaining": "0"} | retry)
        self.log.append(now)
        if len(self.log) == 1:
            head["RateLimit-Reset"] = str(math.ceil(self.window_s))
        return head | {"RateLimit-Remaining": str(self.limit - len(self.log))}


class FixedNoHeaders:
    """rpm*W/60 requests per fixed W s window; tells the client nothing."""

    def __init__(self, rpm: int, window_s: float):
        self.window_s, self.limit = window_s, max(1, math.floor(rpm * window_s / MINUTE_S))
        self.reset()

    def reset(self) -> None:
        self.index, self.count = -1, 0

    def admit(self, tokens: int) -> dict[str, str]:
        index = math.floor(time.time() / self.window_s)
        if index != self.index:
            self.index, self.count = index, 0
        if self.count >= self.limit:
            raise Refusal("requests", None, {})
        self.count += 1
        return {}


class Unlimited:
    def reset(self) -> None:
        pass

    def admit(self, tokens: int) -> dict[str, str]:
        return {}


class Provider:
    """The HTTP side: stats, latency, the policy's admission, the answers."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.limiter = make_limiter(args)
        self.gate = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        self.rng = random.Random(args.seed)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats: dict[str, Any] = {
            "policy": self.args.policy,
            "received": 0,
            "admitted": 0,
            "rate_limited": 0,
            "first_received": None,
            "admissions": [],
            "busy_s": 0.0,
            "in_flight": 0,
            "max_in_flight": 0,
        }

    async def chat(self, request: web.Request) -> web.Response:
        now = time.time()
        body = await request.json()
        self.stats["received"] += 1
        if self.stats["first_received"] is None:
            self.stats["first_received"] = now
        if self.gate is not None:
            async with self.gate:
                return await self._serve(body, self.limiter.admit(0))
        try:
            headers = self.limiter.admit(request_tokens(body))
        except Refusal as refusal:
            self.stats["rate_limited"] += 1
            return refused(refusal, body)
        return await self._serve(body, headers)

    async def _serve(self, body: dict[str, Any], headers: dict[str, str]) -> web.Response:
        started = time.time()
        self.stats["admitted"] += 1
        self.stats["admissions"].append([started, request_tokens(body)])
        self.stats["in_flight"] += 1
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], self.stats["in_flight"])
        try:
            await asyncio.sleep(self.args.latency + self.rng.uniform(0, JITTER_S))
        finally:
            self.stats["in_flight"] -= 1
            self.stats["busy_s"] += time.time() - started
        prompt = math.ceil(len(json.dumps(body.get("messages", []))) / CHARS_PER_TOKEN)
        completion = len(ANSWER.split())
        answer = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(started),
            "model": body.get("model", "unknown"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ANSWER},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }
        return web.json_response(answer, headers=headers)

    async def models(self, request: web.Request) -> web.Response:
        owner = "vllm" if self.args.policy == "concurrency_like_vllm" else "independent-provider"
        entry = {"id": self.args.model, "object": "model", "owned_by": owner}
        if owner == "vllm":
            entry["max_model_len"] = 32768
        return web.json_response({"object": "list", "data": [entry]})

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats)

    async def reset(self, request: web.Request) -> web.Response:
        self.reset_stats()
        self.limiter.reset()
        return web.json_response({"ok": True})


def refused(refusal: Refusal, body: dict[str, Any]) -> web.Response:
    """OpenAI's 429 body; the policy's headers say (or do not say) when to come back."""
    unit = "requests per min (RPM)" if refusal.kind == "requests" else "tokens per min (TPM)"
    wait = "" if refusal.wait_s is None else f" Please try again in {refusal.wait_s:.3f}s."
    error = {
        "message": f"Rate limit reached for {body.get('model')} on {unit}.{wait}",
        "type": refusal.kind,
        "param": None,
        "code": "rate_limit_exceeded",
    }
    return web.json_response({"error": error}, status=429, headers=refusal.headers)


def make_limiter(args: argparse.Namespace) -> Any:
    if args.policy == "openai_bucket":
        return OpenAIBucket(args.rpm, args.tpm, args.start_fill)
    if args.policy == "azure_periods":
        return AzurePeriods(args.rpm, args.tpm)
    if args.policy == "gateway_sliding":
        return GatewaySliding(args.rpm, args.window)
    if args.policy == "no_headers_fixed":
        return FixedNoHeaders(args.rpm, args.window)
    return Unlimited()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", choices=POLICIES, required=True)
    parser.add_argument("--rpm", type=int, default=600)
    parser.add_argument("--tpm", type=int, default=None)
    parser.add_argument("--window", type=float, default=5.0, help="W s (gateway, fixed)")
    parser.add_argument("--concurrency", type=int, default=0, help="in flight (vLLM-like)")
    parser.add_argument("--start-fill", type=float, default=1.0, help="bucket at start, 0-1")
    parser.add_argument("--latency", type=float, default=BASE_LATENCY_S)
    parser.add_argument("--model", default="gpt-4o-mini")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.policy == "concurrency_like_vllm" and not args.concurrency:
        parser.error("concurrency_like_vllm needs --concurrency N")
    if args.policy != "concurrency_like_vllm":
        args.concurrency = 0
    return args


async def serve(args: argparse.Namespace) -> None:
    provider = Provider(args)
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", provider.chat)
    app.router.add_get("/v1/models", provider.models)
    app.router.add_get("/stats", provider.get_stats)
    app.router.add_post("/reset", provider.reset)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=1024)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the port the OS chose for port 0
    print(f"PORT {port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        asyncio.run(serve(parse_args()))
    except KeyboardInterrupt:
        pass
