"""An OpenAI-compatible provider simulator with exact rate limits, OpenAI's 429s, and faults.

It is the demo's default provider and the ground truth of the tests and benchmarks: GET /stats
says what it admitted, per second and (with ?log=1) per request, and how many it refused.
Modules by role: config.py (the settings), limits.py (enforcement), counting.py (how prompts
are counted), chat.py (the chat route), content.py and answers.py (what it answers),
responses.py (errors and headers), stats.py (GET /stats), slots.py (a self-hosted server's
decode slots and queue), tiers.py (service tiers: flex), batch.py (the Batch API).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from collections import Counter

from aiohttp import web

from ..engine.tokens import encoding_for
from . import embeddings, kinds
from .answers import echo_key
from .chat import chat
from .config import LIMIT_SETTINGS, SimConfig, check, updated
from .limits import Limit, make_limit
from .responses import error, openai_duration
from .slots import DecodeSlots
from .stats import Stats

__all__ = ["SimConfig", "Simulator", "SimulatorThread", "openai_duration", "start_site"]


class Simulator:
    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = check(config or SimConfig())
        for model in self.config.models:
            encoding_for(model)  # loading an encoding takes ~1 s: not inside the first request
        self.slots = DecodeSlots()
        self.reset()

    def reset(self) -> None:
        """Fresh limits (full, as for a new key), counters and admission log."""
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
        self.limits: dict[str, Limit | None] = {
            "requests": make_limit(cfg.rpm, **shape) if cfg.rpm else None,
            "tokens": make_limit(cfg.tpm, **shape) if cfg.tpm else None,
        }
        self.stats = Stats()
        self.slots.reset()

    @property
    def counts(self) -> Counter[str]:
        return self.stats.counts

    # -- HTTP ------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)

        async def chat_route(request: web.Request) -> web.StreamResponse:
            return await chat(self, request)

        app.router.add_post("/v1/chat/completions", chat_route)
        app.router.add_post("/openai/deployments/{deployment}/chat/completions", chat_route)
        embeddings.register(self, app)  # POST /v1/embeddings (simulator/embeddings.py)
        app.router.add_get("/v1/models", self.models)
        for path in kinds.ROOT_ROUTES:  # what a client probes (simulator/kinds.py)
            app.router.add_get(path, self.root_route)
        app.router.add_get("/stats", self.stats_route)
        app.router.add_post("/admin/config", self.set_config)
        app.router.add_post("/admin/reset", self.admin_reset)
        # Batch API (issue 13): /v1/files, /v1/batches, /admin/batch_config
        from .batch import BatchAPI

        BatchAPI(self).register(app)
        return app

    async def models(self, request: web.Request) -> web.Response:
        self.counts["probe_/v1/models"] += 1
        cfg = self.config
        models = kinds.served_models(cfg) | embeddings.listed(cfg)
        return web.json_response(kinds.models_body(cfg.server_kind, models))

    async def root_route(self, request: web.Request) -> web.Response:
        self.counts[f"probe_{request.path}"] += 1
        cfg = self.config
        status, body = kinds.root_route(cfg.server_kind, request.path, kinds.served_models(cfg))
        if body is None:
            return web.Response(status=status)
        return web.json_response(body, status=status)

    async def stats_route(self, request: web.Request) -> web.Response:
        config = dataclasses.asdict(self.config) | {"api_key": None}  # never the key
        log = request.query.get("log", "") not in ("", "0", "false")
        messages = request.query.get("messages", "") not in ("", "0", "false")
        body = self.stats.body(config, log=log, messages=messages)
        return web.json_response(body | self.slots.stats())

    async def set_config(self, request: web.Request) -> web.Response:
        try:
            updates = await request.json()
            self.config = updated(self.config, updates)
        except ValueError as exc:  # also a body that is not JSON
            return error(400, str(exc), "invalid_request_error", None)
        if set(updates) & LIMIT_SETTINGS:  # a limit set again starts full, as a new key
            self.reset()
        return web.json_response({"ok": True})

    async def admin_reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"ok": True})

    def auth_error(self, request: web.Request) -> web.Response | None:
        want = self.config.api_key
        if not want:
            return None
        got = request.headers.get("api-key") or request.headers.get("Authorization", "")
        got = got.removeprefix("Bearer ").strip()
        if got == want:
            return None
        masked = echo_key(got, self.config.key_echo)
        # Like OpenAI, the message echoes a masked key: the client must not log even that.
        return error(
            401,
            f"Incorrect API key provided: {masked}. You can find your API key in your account.",
            "invalid_request_error",
            "invalid_api_key",
        )

    # -- faults ----------------------------------------------------------------------------
    def draw_fault(self) -> str | None:
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

    async def fault(self, request: web.Request, fault: str, headers: dict[str, str]):
        if fault == "500":
            message = "The server had an error while processing your request."
            return error(500, message, "server_error", None, headers)
        if fault == "503":
            message = "The engine is currently overloaded, please try again later."
            return error(503, message, "server_error", None, headers)
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
