"""An OpenAI-compatible provider simulator with exact rate limits, OpenAI's 429s, and faults.

It is the demo's default provider and the ground truth of the tests and benchmarks: GET /stats
says what it admitted, per second, and how many requests it refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import random
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ..engine.tokens import count_prompt_tokens, count_text_tokens, encoding_for
from . import structured
from .answers import draw_shape, echo_key, rejection, shaped_choice
from .limits import chars4_tokens, make_limit

_WORDS = [
    "the",
    "market",
    "price",
    "rose",
    "after",
    "strong",
    "earnings",
    "while",
    "analysts",
    "expect",
    "growth",
    "in",
    "demand",
    "and",
    "the",
    "company",
    "said",
    "revenue",
    "fell",
    "as",
    "costs",
    "increased",
    "but",
    "investors",
    "remain",
    "calm",
    "about",
    "risk",
    "shares",
    "bank",
    "rate",
    "policy",
    "trade",
    "oil",
    "data",
    "report",
    "quarter",
    "profit",
    "loss",
    "outlook",
]


@dataclass
class SimConfig:
    """Everything the simulator does, changeable at run time through POST /admin/config."""

    rpm: int | None = None
    tpm: int | None = None
    bucket_s: float = 1.0  # capacity of each bucket, in seconds of its limit
    latency_ms: float = 20.0
    latency_per_token_ms: float = 0.2
    jitter: float = 0.2
    fail_500: float = 0.0
    fail_503: float = 0.0
    hang: float = 0.0
    hang_s: float = 600.0
    malformed: float = 0.0
    drop: float = 0.0
    api_key: str | None = None
    fail_429_every: int = 0  # every Nth request that passes the limits gets a 429 (0: never)
    fail_429_retry_after_s: float = 0.2
    surrogate_every: int = 0  # every Nth answer ends with a lone UTF-16 surrogate (0: never)
    models: dict[str, int] = field(
        default_factory=lambda: {"sim-1": 16_384, "gpt-4o-mini": 128_000}
    )
    default_max_tokens: int = 16
    max_answer_tokens: int = 48
    seed: int = 0
    # Answer shapes (simulator/answers.py): the fraction of prompts answered that way.
    answer_null_content: float = 0.0
    answer_refusal: float = 0.0
    answer_content_filter: float = 0.0
    answer_length: float = 0.0
    answer_tool_calls: float = 0.0
    answer_empty_choices: float = 0.0
    # How 401s (and the fail_400_key_echo fraction of 400s) echo the key sent: masked (None),
    # suffix, middle, urlencoded or json.
    key_echo: str | None = None
    fail_400_key_echo: float = 0.0
    fail_marker: str | None = None  # prompts containing it always get a 400
    # Typed outputs (simulator/structured.py): fractions of schema answers that are invalid JSON,
    # truncated JSON or refusals; reject_json_schema answers json_schema with HTTP 500.
    invalid_json: float = 0.0
    truncated_json: float = 0.0
    refuse: float = 0.0
    reject_json_schema: bool = False

    # How real providers differ (simulator/limits.py): enforcement bucket | fixed_window |
    # sliding_window | quantized; window_s for the windows, quantum_s for quantized.
    enforcement: str = "bucket"
    window_s: float = 10.0
    quantum_s: float = 1.0
    counting: str = "tiktoken"  # or "chars4": a quarter of the request body's characters
    usage_shape: str = "openai"  # or "input_output", or "none" (no usage block)
    retry_after: str = "both"  # retry-after-ms + whole seconds; "seconds" (rounded up); "ms"
    limit_header: str = "per_minute"  # or "capacity" (the bucket's), or "none"
    rate_headers: bool = True  # x-ratelimit-remaining-* / -reset-* on every answer
    reasoning: bool = False  # reject max_tokens (400 unsupported_parameter), as gpt-5 / o-series
    insufficient_quota: bool = False  # every request: 429 insufficient_quota
    fail_param: str | None = None  # a deterministic 500 for every body that has this parameter


def openai_duration(seconds: float) -> str:
    """OpenAI's x-ratelimit-reset-* format: 12ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    rest_s = f"{rest:.3f}".rstrip("0").rstrip(".")
    return f"{int(minutes)}m{rest_s}s" if minutes else f"{rest_s}s"


def _error(
    status: int, message: str, type_: str, code: str | None, headers=None, param=None
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


class Simulator:
    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        for model in self.config.models:
            encoding_for(model)  # loading an encoding takes ~1 s: not inside the first request
        self.reset()

    def reset(self) -> None:
        cfg = self.config
        self.rng = random.Random(cfg.seed)
        now = time.monotonic()
        shape = {
            "enforcement": cfg.enforcement,
            "bucket_s": cfg.bucket_s,
            "window_s": cfg.window_s,
            "quantum_s": cfg.quantum_s,
            "now": now,
        }
        self.req_bucket = make_limit(cfg.rpm, **shape) if cfg.rpm else None
        self.tok_bucket = make_limit(cfg.tpm, **shape) if cfg.tpm else None
        self.counts: Counter[str] = Counter()
        self.per_second: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
        self.prompts: Counter[str] = Counter()
        self.started = time.time()

    # -- HTTP ------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/openai/deployments/{deployment}/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/stats", self.stats)
        app.router.add_post("/admin/config", self.set_config)
        app.router.add_post("/admin/reset", self.admin_reset)
        # Batch API (issue 13): /v1/files, /v1/batches, /admin/batch_config
        from .batch import BatchAPI

        BatchAPI(self).register(app)
        return app

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {"id": m, "object": "model", "owned_by": "simulator", "max_model_len": n}
            for m, n in self.config.models.items()
        ]
        return web.json_response({"object": "list", "data": data})

    async def stats(self, request: web.Request) -> web.Response:
        series = [
            {"t": t, "requests": v[0], "tokens": v[1], "rate_limited": v[2]}
            for t, v in sorted(self.per_second.items())
        ]
        body = {
            **self.counts,
            "config": dataclasses.asdict(self.config) | {"api_key": None},
            "series": series,
            "distinct_prompts": len(self.prompts),
            "resent_prompts": sum(n - 1 for n in self.prompts.values() if n > 1),
        }
        return web.json_response(body)

    async def set_config(self, request: web.Request) -> web.Response:
        updates = await request.json()
        unknown = set(updates) - {f.name for f in dataclasses.fields(SimConfig)}
        if unknown:
            return _error(
                400, f"unknown settings: {sorted(unknown)}", "invalid_request_error", None
            )
        self.config = dataclasses.replace(self.config, **updates)
        if {"rpm", "tpm", "bucket_s", "seed", "enforcement", "window_s", "quantum_s"} & set(
            updates
        ):
            self.reset()
        return web.json_response({"ok": True})

    async def admin_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"ok": True})

    def _auth_error(self, request: web.Request) -> web.Response | None:
        want = self.config.api_key
        if not want:
            return None
        got = request.headers.get("api-key") or request.headers.get("Authorization", "")
        got = got.removeprefix("Bearer ").strip()
        if got == want:
            return None
        masked = echo_key(got, self.config.key_echo)
        # Like OpenAI, the message echoes a masked key: the client must not log even that.
        return _error(
            401,
            f"Incorrect API key provided: {masked}. You can find your API key in your account.",
            "invalid_request_error",
            "invalid_api_key",
        )

    def _limit_headers(self) -> dict[str, str]:
        cfg = self.config
        h: dict[str, str] = {}
        now = time.monotonic()
        for name, bucket in (("requests", self.req_bucket), ("tokens", self.tok_bucket)):
            if bucket is None:
                continue
            if cfg.limit_header == "per_minute":
                h[f"x-ratelimit-limit-{name}"] = str(bucket.per_min)
            elif cfg.limit_header == "capacity":
                h[f"x-ratelimit-limit-{name}"] = str(int(bucket.capacity))
            if cfg.rate_headers:
                h[f"x-ratelimit-remaining-{name}"] = str(bucket.remaining(now))
                h[f"x-ratelimit-reset-{name}"] = openai_duration(bucket.reset_s(now))
        return h

    def _retry_headers(self, wait: float) -> dict[str, str]:
        style = self.config.retry_after
        h = {}
        if style in ("both", "ms"):
            h["retry-after-ms"] = str(max(1, round(wait * 1000)))
        if style in ("both", "seconds"):
            h["retry-after"] = str(max(1, math.ceil(wait)))
        return h

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.counts["received"] += 1
        denied = self._auth_error(request)
        if denied is not None:
            self.counts["unauthorized"] += 1
            return denied
        try:
            body = await request.json()
            messages = body["messages"]
            model = request.match_info.get("deployment") or body["model"]
        except (ValueError, KeyError, TypeError):
            return _error(
                400,
                "request body must be JSON with model and messages",
                "invalid_request_error",
                None,
            )
        cfg = self.config
        temperature = body.get("temperature")
        if temperature is not None and not (
            isinstance(temperature, int | float) and 0 <= temperature <= 2
        ):
            return _error(
                400,
                f"Invalid 'temperature': {temperature!r}; expected a number from 0 to 2.",
                "invalid_request_error",
                "invalid_value",
            )
        if cfg.reject_json_schema and structured.rejects(body):  # like an older llama.cpp server
            self.counts["rejected_json_schema"] += 1
            return _error(500, structured.REJECTION_MESSAGE, "server_error", None)
        if cfg.reasoning and "max_tokens" in body:
            self.counts["unsupported_parameter"] += 1
            return _error(
                400,
                "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                "'max_completion_tokens' instead.",
                "invalid_request_error",
                "unsupported_parameter",
                param="max_tokens",
            )
        if cfg.insufficient_quota:
            self.counts["insufficient_quota"] += 1
            return _error(
                429,
                "You exceeded your current quota, please check your plan and billing details.",
                "insufficient_quota",
                "insufficient_quota",
            )
        if cfg.fail_param and cfg.fail_param in body:
            self.counts["fail_param"] += 1
            return _error(500, f"Unsupported '{cfg.fail_param}'", "server_error", None)
        if model not in cfg.models:
            self.counts["not_found"] += 1
            return _error(
                404,
                f"The model `{model}` does not exist or you do not have access to it.",
                "invalid_request_error",
                "model_not_found",
            )
        refused = self._refused(request, messages)
        if refused is not None:
            return refused
        if cfg.counting == "chars4":
            prompt_tokens = chars4_tokens(json.dumps(messages))
        else:
            prompt_tokens = count_prompt_tokens(messages, model)
        max_tokens = int(
            body.get("max_completion_tokens") or body.get("max_tokens") or cfg.default_max_tokens
        )
        window = cfg.models[model]
        if prompt_tokens + max_tokens > window:
            self.counts["context_length"] += 1
            return _error(
                400,
                f"This model's maximum context length is {window} tokens. However, "
                f"you requested {prompt_tokens + max_tokens} tokens.",
                "invalid_request_error",
                "context_length_exceeded",
            )

        cost = prompt_tokens + max_tokens
        if cfg.tpm and cost > cfg.tpm:
            self.counts["too_large"] += 1
            return _error(
                429,
                f"Request too large for {model} on tokens per min (TPM): Limit {cfg.tpm}, "
                f"Requested {cost}.",
                "tokens",
                "rate_limit_exceeded",
            )
        now = time.monotonic()
        waits = [
            b.wait_for(c, now)
            for b, c in ((self.req_bucket, 1), (self.tok_bucket, cost))
            if b is not None
        ]
        second = int(time.time())
        if any(waits):
            self.counts["rate_limited"] += 1
            self.per_second[second][2] += 1
            wait = max(waits)
            which = (
                "tokens" if self.tok_bucket and self.tok_bucket.wait_for(cost, now) else "requests"
            )
            headers = self._limit_headers() | self._retry_headers(wait)
            return _error(
                429,
                f"Rate limit reached for {model} on {which} per min. Please try "
                f"again in {openai_duration(wait)}.",
                which,
                "rate_limit_exceeded",
                headers,
            )
        if cfg.fail_429_every > 0:
            self.counts["seen_for_429"] += 1
            if self.counts["seen_for_429"] % cfg.fail_429_every == 0:
                return self._injected_429(model)
        for b, c in ((self.req_bucket, 1), (self.tok_bucket, cost)):
            if b is not None:
                b.take(c, now)
        self.counts["admitted_requests"] += 1
        self.counts["admitted_tokens"] += cost
        self.per_second[second][0] += 1
        self.per_second[second][1] += cost
        headers = self._limit_headers()

        fault = self._draw_fault()
        if fault:
            self.counts[f"fault_{fault}"] += 1
            return await self._fault(request, fault, headers)

        refusal = None
        schema = structured.requested_schema(body)
        if schema is not None:  # typed outputs: JSON generated from the schema
            content, refusal, completion_tokens, finish = self._structured(
                schema, messages, model, max_tokens
            )
        else:
            content, completion_tokens, finish = self._answer(messages, model, max_tokens)
        if cfg.surrogate_every > 0:
            self.counts["seen_for_surrogate"] += 1
        if cfg.surrogate_every > 0 and self.counts["seen_for_surrogate"] % cfg.surrogate_every == 0:
            content += "\ud83d"  # valid JSON ("\\ud83d"), not valid Unicode text
            self.counts["fault_surrogate"] += 1
        choices = [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": refusal},
                "finish_reason": finish,
                "logprobs": None,
            }
        ]
        shape = draw_shape(cfg, _digest(messages))
        if shape is not None:
            self.counts[f"shape_{shape}"] += 1
            choices, completion_tokens = shaped_choice(
                shape, content, completion_tokens, max_tokens
            )
        jitter = 1 + cfg.jitter * (2 * self.rng.random() - 1)
        delay = (cfg.latency_ms + cfg.latency_per_token_ms * completion_tokens) * jitter / 1000
        if delay > 0:
            await asyncio.sleep(delay)
        self.counts["answered"] += 1
        self.counts["completion_tokens"] += completion_tokens
        self.prompts[_digest(messages)] += 1
        return web.json_response(
            {
                "id": f"chatcmpl-{self.counts['answered']}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": choices,
                **self._usage(prompt_tokens, completion_tokens),
            },
            headers=headers,
        )

    def _refused(self, request: web.Request, messages: list[Any]) -> web.Response | None:
        """A 400 for a prompt with the fail marker, or one quoting the key (answers.rejection)."""
        got = request.headers.get("api-key") or request.headers.get("Authorization", "")
        message = rejection(self.config, messages, got.removeprefix("Bearer ").strip(), self.rng)
        if message is None:
            return None
        self.counts["rejected_400"] += 1
        return _error(400, message, "invalid_request_error", None)

    def _injected_429(self, model: str) -> web.Response:
        """A deterministic 429 (fail_429_every), as if another client had emptied the bucket."""
        wait = self.config.fail_429_retry_after_s
        self.counts["rate_limited"] += 1
        self.counts["fault_429"] += 1
        self.per_second[int(time.time())][2] += 1
        headers = self._limit_headers() | {
            "retry-after-ms": str(max(1, round(wait * 1000))),
            "retry-after": str(max(1, round(wait))),
        }
        return _error(
            429,
            f"Rate limit reached for {model} on requests per min. Please try again in "
            f"{openai_duration(wait)}.",
            "requests",
            "rate_limit_exceeded",
            headers,
        )

    def _usage(self, prompt: int, completion: int) -> dict[str, Any]:
        shape = self.config.usage_shape
        if shape == "none":
            return {}
        if shape == "input_output":
            return {"usage": {"input_tokens": prompt, "output_tokens": completion}}
        return {
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
        }

    def _draw_fault(self) -> str | None:
        cfg = self.config
        x = self.rng.random()
        for name, p in (
            ("500", cfg.fail_500),
            ("503", cfg.fail_503),
            ("hang", cfg.hang),
            ("malformed", cfg.malformed),
            ("drop", cfg.drop),
        ):
            if x < p:
                return name
            x -= p
        return None

    async def _fault(self, request: web.Request, fault: str, headers: dict[str, str]):
        if fault == "500":
            return _error(
                500,
                "The server had an error while processing your request.",
                "server_error",
                None,
                headers,
            )
        if fault == "503":
            return _error(
                503,
                "The engine is currently overloaded, please try again later.",
                "server_error",
                None,
                headers,
            )
        if fault == "hang":
            await asyncio.sleep(self.config.hang_s)
        if fault == "malformed":
            return web.Response(
                text='{"id": "chatcmpl-broken", "choices": [{"mess',
                content_type="application/json",
                headers=headers,
            )
        # drop (and a hang that outlived its sleep): close the connection without an answer
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError

    def _answer(self, messages: list[dict[str, Any]], model: str, max_tokens: int):
        """Deterministic content from the prompt; an 'Answer with one of: a, b, c' prompt gets a label."""
        digest = _digest(messages)
        seed = int(digest[:12], 16)
        text = "\n".join(str(m.get("content") or "") for m in messages)
        marker = "Answer with one of:"
        if marker in text:
            options = text.split(marker, 1)[1].splitlines()[0].strip().rstrip(".")
            labels = [o.strip() for o in options.split(",") if o.strip()]
            if labels:
                content = labels[seed % len(labels)]
                return self._fit(content, model, max_tokens)
        rng = random.Random(seed)
        n = rng.randint(3, max(3, self.config.max_answer_tokens))
        content = " ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + "."
        return self._fit(content, model, max_tokens)

    def _structured(self, schema: dict[str, Any], messages, model: str, max_tokens: int):
        """(content, refusal, completion tokens, finish_reason) of a schema request."""
        cfg = self.config
        seed = int(_digest(messages)[:12], 16)
        content, refusal, cut = structured.answer(
            schema, seed, invalid=cfg.invalid_json, truncated=cfg.truncated_json, refuse=cfg.refuse
        )
        if content is None:
            return None, refusal, count_text_tokens(refusal or "", model), "stop"
        content, n, finish = self._fit(content, model, max_tokens)
        return content, None, n, "length" if cut else finish

    @staticmethod
    def _fit(content: str, model: str, max_tokens: int) -> tuple[str, int, str]:
        enc = encoding_for(model)
        if enc is None:
            n = count_text_tokens(content, model)
            return content, n, "stop"
        ids = enc.encode(content, disallowed_special=())
        if len(ids) > max_tokens:
            return enc.decode(ids[:max_tokens]), max_tokens, "length"
        return content, len(ids), "stop"


def _digest(messages: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()


async def start_site(
    sim: Simulator, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, str]:
    # A client that hangs up before its answer gets none, like a real provider's dropped stream;
    # so `answered` counts answers that reached a client.
    runner = web.AppRunner(
        sim.app(), access_log=None, handle_signals=False, handler_cancellation=True
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    sock = site._server.sockets[0]  # aiohttp offers no public accessor for the bound port
    bound = sock.getsockname()[1]
    return runner, f"http://{host}:{bound}/v1"


class SimulatorThread:
    """The simulator on its own event loop in a background thread, for in-process use."""

    def __init__(self, config: SimConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        self.sim = Simulator(config)
        self._host, self._port = host, port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    def start(self) -> SimulatorThread:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(
            start_site(self.sim, self._host, self._port), self._loop
        )
        self._runner, self.url = fut.result(timeout=10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> SimulatorThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
