"""Opening an LLMResource's engine: ask a self-hosted server what it is, then bind the
transport, the shared limiter and the concurrency gate to the running event loop."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from ..engine import _constants as C
from ..engine.budget import Cost, DailyLedger, SpendCap
from ..engine.engine import Engine, EngineSettings
from ..engine.errors import BatchLLMError
from ..engine.gate import ConcurrencyGate, concurrency_namespace
from ..engine.limiter import LimiterSettings, RedisLimiter, limiter_namespace
from ..engine.redis_client import check_redis, connect_redis, safe_url
from ..engine.server_probe import discover_context_window, probe_server
from ..engine.transport import TRANSPORTS

if TYPE_CHECKING:
    from .llm import LLMResource


def engine_settings(
    llm: LLMResource, *, model: str | None = None, params: dict[str, Any] | None = None
) -> EngineSettings:
    """The resource's engine settings, `model` and `params` over its own."""
    model = model or llm.model
    params = {**llm.params, **(params or {})}
    return EngineSettings(
        model=model,
        params=params,
        max_concurrency=llm.concurrency,
        request_timeout_s=llm.timeout_for(params),
        max_attempts=llm.max_attempts,
        deadline_s=llm.deadline_s,
        default_max_tokens=llm.default_max_tokens,
        context_window=llm.context_window or C.context_window_for(model),
        refund_unused_completion=llm.refund_unused_completion,
        fatal_error_threshold=llm.fatal_error_threshold,
        secret=llm.api_key,
        estimate_margin=llm.estimate_margin,
        breaker_threshold=llm.breaker_threshold,
        flex_fallback=llm.flex_fallback,
    )


async def know_server(llm: LLMResource, settings: EngineSettings) -> None:
    """Ask a self-hosted server what it is (once per model; not when `provider` names it)
    and the model's context window; the profile's defaults then follow what it said. A
    hosted API is never asked. The window the server reports beats the known-models
    table (a local server may serve any model under a hosted model's name)."""
    if llm.profile.hosted:
        return
    headers = {"Authorization": f"Bearer {llm.api_key}"} if llm.api_key else {}
    if llm.provider is not None:
        if not settings.context_window:
            settings.context_window = await discover_context_window(
                base_url=llm.base_url, model=settings.model, headers=headers
            )
        return
    info = llm._servers.get(settings.model)
    if info is None:
        info = await probe_server(base_url=llm.base_url, model=settings.model, headers=headers)
        llm._servers[settings.model] = info
    if not llm.context_window and info.context_window:
        settings.context_window = info.context_window
    settings.max_concurrency = llm.concurrency
    settings.request_timeout_s = llm.timeout_for(settings.params)


def spend_cap(
    llm: LLMResource, priced: Callable[[], Cost | None] | None, *, model: str
) -> SpendCap | None:
    """The resource's spend caps over requests priced by `priced()` (engine/budget.py), or
    None when it sets none. A cap over requests nobody prices cannot hold: that is refused."""
    cost = priced() if priced is not None else None
    ledgers: list[Any] = [llm.run_spend()] if llm.budget_usd is not None else []
    if llm.budget_usd_per_day is not None:
        assert llm.redis_url is not None  # LLMResource's validator
        ledgers.append(DailyLedger(llm.redis_url, cap_usd=llm.budget_usd_per_day, job=llm.job_key))
    if not ledgers:
        return None
    if priced is None:
        raise BatchLLMError(
            description="budget_usd / budget_usd_per_day is set, but LLMResource.chat_batch and "
            "engine() do not price their requests, so no cap can hold: use a resource without "
            "budgets there (the assets' runs price theirs)."
        )
    if cost is None:
        raise BatchLLMError(
            description=f"budget_usd / budget_usd_per_day is set, but requests to model "
            f"{model!r} at {safe_url(llm.base_url)} are not priced (a self-hosted server, or a "
            "model genai-prices does not list), so no cap can hold. Set price_input_per_1m and "
            "price_output_per_1m (or price_as_model) on the LLM resource, or unset the budgets."
        )
    return SpendCap(ledgers, cost)


@contextlib.asynccontextmanager
async def open_engine(
    llm: LLMResource,
    *,
    model: str | None = None,
    params: dict[str, Any] | None = None,
    priced: Callable[[], Cost | None] | None = None,
) -> AsyncIterator[Engine]:
    """An engine bound to the running event loop; closes its connections on exit.

    `model` and `params` override the resource's for this engine (one asset, one model).
    `priced` is asked for the requests' price once the server is known (the caps need it).
    """
    model = model or llm.model
    settings = llm.engine_settings(model=model, params=params)
    await know_server(llm, settings)
    cap = spend_cap(llm, priced, model=model)
    transport = TRANSPORTS[llm.transport](
        base_url=llm.base_url,
        api_key=llm.api_key,
        api_version=llm.api_version,
        model=model,
        max_connections=settings.max_concurrency,
    )
    limiter = gate = engine = None
    shared = llm.adaptive and llm.redis_url is not None  # runs on one server share it
    client = await _open_redis(llm, transport) if llm.limited or shared else None
    if llm.limited:
        limiter = RedisLimiter(
            client,
            namespace=limiter_namespace(llm.base_url, model, llm.api_key),
            settings=LimiterSettings(rpm=llm.rpm, tpm=llm.tpm, burst_s=llm.burst_s),
            job=llm.job_key,
            weight=llm.job_weight,
            where=safe_url(llm.effective_redis_url or ""),
        )
    if llm.adaptive:
        gate = ConcurrencyGate(
            max_concurrency=llm.concurrency,
            client=client if shared else None,
            namespace=concurrency_namespace(llm.base_url),
        )
    try:
        if limiter is not None:
            await limiter.prepare()
        engine = Engine(settings, transport, limiter, gate)
        engine.budget = await cap.open() if cap is not None else None
        yield engine
    finally:
        if cap is not None:
            await cap.aclose()
        if engine is not None:
            await engine.drain()
        if gate is not None:
            await gate.close()
        if limiter is not None:
            await limiter.release()
        if client is not None:
            await client.aclose()
        await transport.aclose()


async def _open_redis(llm: LLMResource, transport: Any) -> Any:
    """A client of the limiter's Redis, connected and authenticated (else all is closed)."""
    if llm.effective_redis_url is None:
        llm.start()
    url = llm.effective_redis_url
    client = connect_redis(url)
    try:
        await check_redis(client, url)
    except BaseException:
        await client.aclose()
        await transport.aclose()
        raise
    return client
