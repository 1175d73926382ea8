"""LLMResource: any OpenAI-compatible endpoint behind a shared Redis limiter, with retries."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any, Literal

import dagster as dg
from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from ..engine import _constants as C
from ..engine.budget import Cost, RunLedger, check_budget
from ..engine.engine import ChatRequest, ChatResult, Engine, EngineSettings
from ..engine.flex import FALLBACKS, asks_flex
from ..engine.profiles import Profile, profile_for
from ..engine.server_probe import ServerInfo
from ..engine.structured import provider_kind
from ..engine.valkey import EmbeddedValkey
from .llm_engine import engine_settings, open_engine

log = logging.getLogger(__name__)


class LLMResource(dg.ConfigurableResource):
    """Chat completions for many rows at once, just under the provider's limits.

    Every process that uses the same base_url + model + api_key shares one limit through Redis;
    jobs with different `job_key`s share it by `job_weight` while it is saturated.
    """

    base_url: str = Field(
        default=C.DEFAULT_BASE_URL,
        description="OpenAI-compatible endpoint up to /v1 (OpenAI, vLLM, Ollama, llama.cpp "
        "server, the simulator), or the Azure OpenAI resource endpoint when api_version is set.",
    )
    api_key: str = Field(
        default="",
        description="API key. Set it with dg.EnvVar('OPENAI_API_KEY'); it is never logged, never "
        "written to metadata, and redacted from error messages.",
    )
    api_version: str | None = Field(
        default=None,
        description="Azure OpenAI API version (e.g. 2024-10-21). When set, `model` names the "
        "deployment and the key is sent as the api-key header.",
    )
    model: str = Field(default=C.DEFAULT_MODEL, description="Model (or Azure deployment) name.")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Default request parameters (temperature, max_tokens, seed, "
        "response_format, ...); a request's own params override them.",
    )
    provider: str | None = Field(
        default=None,
        description="Provider profile: openai, azure, gemini, vllm, llamacpp, ollama, "
        "llama-cpp-python, generic. It sets the token-limit parameter, default concurrency and "
        "timeout, the structured-output form, usage handling and pricing. None: a hosted API "
        "is known by its base_url (api.openai.com, *.openai.azure.com, "
        "generativelanguage.googleapis.com); any other server is asked what it is once when "
        "the engine opens (/v1/models, /props, /api/version, /version), generic (with a "
        "warning) when it does not say.",
    )
    identity_endpoint: bool = Field(
        default=False,
        description="Put the endpoint (base_url) into each request's identity, which a rerun "
        "compares to skip rows already done. Off: the identity is the exact body, the provider "
        "kind and Azure's api_version, so a self-hosted server that moves (another host or "
        "port) does not make a rerun pay again. Turn it on when two endpoints serve different "
        "models under one name.",
    )
    max_concurrency: int | None = Field(
        default=None,
        ge=1,
        description="Requests in flight per process (at most, for a self-hosted server's "
        "adaptive limit). None: the provider profile's (64 for hosted APIs, 4 for a local "
        "llama.cpp/Ollama server).",
    )
    adaptive_concurrency: bool | None = Field(
        default=None,
        description="Find a self-hosted server's concurrency from its latency instead of "
        "keeping max_concurrency in flight: start at 1 request, grow while latency holds, back "
        "off when requests queue (docs/engine.md). Shared with every run on the same base_url "
        "through redis_url when it is set. None: on for a server that is not a hosted API "
        "when rpm and tpm are unset (off for OpenAI, Azure, Gemini, or a rate-limited "
        "endpoint); it turns itself off when the answers carry rate-limit headers.",
    )
    request_timeout_s: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Timeout of one HTTP attempt. None: the provider profile's (60 s hosted, "
        "up to 600 s for a local server); 900 s for requests with service_tier 'flex' in "
        "params (OpenAI: flex answers more slowly).",
    )
    flex_fallback: str | None = Field(
        default=None,
        description="For requests with service_tier 'flex' in params (OpenAI's flex "
        "processing, at Batch prices): 'standard' sends a row still refused for lack of flex "
        "capacity (429 Resource Unavailable) after max_attempts once more at the standard tier "
        "(service_tier 'auto'), priced at the standard rate; the row's service_tier column says "
        "which tier answered. None: such a row fails resource_unavailable (a rerun sends it "
        "again).",
    )
    max_attempts: int = Field(
        default=C.DEFAULT_MAX_ATTEMPTS, ge=1, description="Attempts per request, first included."
    )
    deadline_s: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        description="Per-request deadline from its start; past it a request fails with "
        "deadline_exceeded and is not sent again. None: bounded by max_attempts only.",
    )
    rpm: int | None = Field(
        default=None, ge=1, description="Requests/min of the key for this model. None: no limit."
    )
    tpm: int | None = Field(
        default=None, ge=1, description="Tokens/min of the key for this model. None: no limit."
    )
    burst_s: float = Field(
        default=C.DEFAULT_BURST_S,
        ge=0,
        le=10,
        description="Burst allowance in seconds of the limit before the provider's headers show "
        "its bucket (keep it below the provider's own). 0: paced from the first request, as "
        "providers that enforce a per-minute limit per second need.",
    )
    refund_unused_completion: bool = Field(
        default=False,
        description="Refund max_tokens minus the completion tokens after each answer. Off by "
        "default because OpenAI and most gateways count max_tokens at admission.",
    )
    default_max_tokens: int = Field(
        default=C.DEFAULT_MAX_TOKENS,
        ge=1,
        description="Answer budget reserved (and sent as max_tokens) when params set none.",
    )
    context_window: int | None = Field(
        default=None,
        description="Context window of the model in tokens; None: known models' table. "
        "Requests over it fail with context_length without being sent.",
    )
    estimate_margin: float | None = Field(
        default=None,
        ge=0,
        le=2,
        description="Fraction added to prompt token estimates. None: 0.25 for a model tiktoken "
        "does not know (its count is a guess), 0 otherwise.",
    )
    breaker_threshold: int = Field(
        default=C.BREAKER_THRESHOLD,
        ge=1,
        description="Stop sending when this many consecutive rows fail with the same "
        "non-transient error (400, 422, or a 5xx that repeats on retry), or, with an "
        "output_schema, whose answers break the same rule of it after their repair.",
    )
    redis_url: str | None = Field(
        default=None,
        description="Redis/Valkey URL for the shared limiter (redis://, rediss://, unix://; "
        "redis+cluster:// or rediss+cluster:// for a Redis Cluster). It is connected and "
        "authenticated when the engine opens. None: a private embedded Valkey is started and "
        "stopped with the resource.",
    )
    job_key: str = Field(
        default="default",
        min_length=1,
        max_length=C.MAX_JOB_KEY_CHARS,
        pattern=C.JOB_KEY_PATTERN,  # it names the limiter's and budget's Redis keys
        description=f"Name of this job for fair sharing (1-{C.MAX_JOB_KEY_CHARS} printable "
        "characters); processes with the same key share one share.",
    )
    job_weight: float = Field(
        default=1.0, gt=0, allow_inf_nan=False, description="Weight of this job's fair share."
    )
    transport: Literal["aiohttp", "openai"] = Field(
        default="aiohttp",
        description="HTTP path: 'aiohttp' (lean, fastest) or 'openai' (the openai SDK).",
    )
    price_input_per_1m: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="USD per 1M input tokens for this model; None: genai-prices' (a local server: not priced).",
    )
    price_output_per_1m: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="USD per 1M output tokens for this model; None: genai-prices' (a local server: not priced).",
    )
    price_cached_input_per_1m: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="USD per 1M cached input tokens; None: the price library's, else the "
        "input price.",
    )
    price_as_model: str | None = Field(
        default=None,
        description="Price requests at this model's list price (genai-prices), e.g. "
        "'gpt-4o-mini' for a simulator or a local server standing in for it. Costs are then "
        "labelled 'simulated at <model> list prices'. Default: None (a local server is not "
        "priced).",
    )
    fatal_error_threshold: int = Field(
        default=C.FATAL_ERROR_THRESHOLD,
        ge=1,
        description="Stop sending after this many 401/403/404 answers in a row.",
    )
    budget_usd: float | None = Field(
        default=None,
        description="Most USD one Dagster run may spend on requests (all its partitions; outside "
        "Dagster, this resource object's life). Each request's worst case (its prompt plus "
        "max_tokens at the model's prices) is held before it is sent and replaced by its real "
        "cost on the answer. When the next request does not fit, nothing more is sent, the rows "
        "left are recorded failed `budget_exhausted` and the run fails; a rerun with a larger "
        "budget sends only those. Needs a priced model (a listed one, price_* or "
        "price_as_model). Enforced for the assets' runs, live and batch mode. None: no cap.",
    )
    budget_usd_per_day: float | None = Field(
        default=None,
        description="Most USD all runs with this job_key may spend per UTC day, together: "
        "counted in redis_url's Redis (required), so concurrent partitions and processes "
        "share it; held and reconciled per request as budget_usd. Give an asset its own "
        "job_key to cap it alone. None: no cap.",
    )

    _valkey: EmbeddedValkey | None = PrivateAttr(default=None)
    _servers: dict[str, ServerInfo] = PrivateAttr(default_factory=dict)  # model -> the probe's
    _run_spend: RunLedger | None = PrivateAttr(default=None)  # budget_usd's, for this run

    @field_validator("base_url")
    @classmethod
    def _check_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {v!r}")
        return v

    @field_validator("flex_fallback")
    @classmethod
    def _check_flex_fallback(cls, v: str | None) -> str | None:
        if v not in FALLBACKS:
            raise ValueError(f"flex_fallback must be 'standard' or None, got {str(v)[:40]!r}")
        return v

    @field_validator("budget_usd", "budget_usd_per_day", mode="before")
    @classmethod
    def _check_budget(cls, v: Any, info: ValidationInfo) -> float | None:
        return check_budget(str(info.field_name), v)

    @model_validator(mode="after")
    def _daily_budget_needs_redis(self) -> LLMResource:
        if self.budget_usd_per_day is not None and not self.redis_url:
            raise ValueError(
                "budget_usd_per_day needs redis_url: the day's spend is counted in a Redis that "
                "every run of the job shares (the embedded one lives only as long as a process)"
            )
        return self

    @field_validator("provider")
    @classmethod
    def _check_provider(cls, v: str | None) -> str | None:
        if v is not None:
            profile_for(v, "")  # raises naming the known providers
        return v

    def __repr_args__(self):  # keep the key out of reprs, logs and tracebacks
        for name, value in super().__repr_args__():
            yield name, ("***" if name == "api_key" and value else value)

    @property
    def server_kind(self) -> str | None:
        """What the server said it is when the engine opened (server_probe.py), or None."""
        return next((s.kind for s in self._servers.values()), None)

    @property
    def profile(self) -> Profile:
        """The provider's profile: the setting, a hosted API's URL, else what the server said."""
        name = self.provider or self.server_kind
        return profile_for(name, self.base_url, api_version=self.api_version)

    def served_name(self, model: str) -> str | None:
        """The model the server said it serves when it does not list `model` (already warned
        about when the engine opened), else None."""
        info = self._servers.get(model)
        return info.models[0] if info is not None and not info.serves(model) else None

    @property
    def structured_kind(self) -> str:
        """The structured-output form typed outputs are asked in (engine/structured.py)."""
        return provider_kind(
            self.base_url,
            api_version=self.api_version,
            provider=self.provider,
            detected=self.server_kind,
        )

    @property
    def concurrency(self) -> int:
        """Requests in flight per process: the setting, else the provider profile's."""
        return self.max_concurrency or self.profile.max_concurrency

    @property
    def adaptive(self) -> bool:
        """An adaptive in-flight limit: the setting, else for a server that is not a hosted API
        and has no rpm/tpm set (a rate-limited endpoint keeps max_concurrency in flight)."""
        if self.adaptive_concurrency is not None:
            return self.adaptive_concurrency
        return not self.profile.hosted and not self.limited

    @property
    def limited(self) -> bool:
        return bool(self.rpm or self.tpm)

    # -- lifecycle -----------------------------------------------------------------------
    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._run_spend = None  # a run's budget_usd starts unspent
        self.start()

    def run_spend(self) -> RunLedger | None:
        """What this run spent against budget_usd (one ledger for all its partitions)."""
        if self.budget_usd is None:
            return None
        if self._run_spend is None:
            self._run_spend = RunLedger(self.budget_usd)
        return self._run_spend

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        self.stop()

    def start(self) -> None:
        """Start the embedded Valkey when limits are set and no redis_url is given."""
        if self.limited and self.redis_url is None and self._valkey is None:
            self._valkey = EmbeddedValkey().start()

    def stop(self) -> None:
        if self._valkey is not None:
            self._valkey.stop()
            self._valkey = None

    def __enter__(self) -> LLMResource:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def effective_redis_url(self) -> str | None:
        if self.redis_url:
            return self.redis_url
        return self._valkey.url if self._valkey else None

    # -- use -------------------------------------------------------------------------------
    def engine_settings(
        self, *, model: str | None = None, params: dict[str, Any] | None = None
    ) -> EngineSettings:
        """The engine's settings: the resource's, `model` and `params` over them."""
        return engine_settings(self, model=model, params=params)

    def timeout_for(self, params: dict[str, Any]) -> float:
        """request_timeout_s, else OpenAI's advice for flex requests (engine/flex.py), else the
        provider profile's."""
        if self.request_timeout_s:
            return self.request_timeout_s
        return C.FLEX_REQUEST_TIMEOUT_S if asks_flex(params) else self.profile.request_timeout_s

    def engine(
        self,
        *,
        model: str | None = None,
        params: dict[str, Any] | None = None,
        priced: Callable[[], Cost | None] | None = None,
    ) -> contextlib.AbstractAsyncContextManager[Engine]:
        """An engine bound to the running event loop; closes its connections on exit.

        `model` and `params` override the resource's for this engine (one asset, one model).
        `priced`, asked once the server is known, gives the requests' price; the budgets need
        it (without it, an engine of a resource with a budget does not open).
        """
        return open_engine(self, model=model, params=params, priced=priced)

    async def chat_batch(
        self, requests: Iterable[ChatRequest] | AsyncIterable[ChatRequest]
    ) -> AsyncIterator[ChatResult]:
        """Yield one ChatResult per request, in completion order.

        Cancel-safe: when the consumer stops early (an exception, `aclose()`, cancellation),
        the workers are cancelled, the limiter lease released and the connections closed.
        """
        async with self.engine() as engine:
            async with contextlib.aclosing(engine.map(requests)) as results:
                async for result in results:
                    yield result
