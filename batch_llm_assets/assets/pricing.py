"""What a request cost, from genai-prices (pydantic's maintained price data, bundled offline).

Models are matched exactly as the library lists them (dated snapshots, -pro variants), cached
input tokens at their own rate, Batch API prices when asked, and flex prices for the rows a
flex tier answered (`cost_usd(tier=...)`; `check_flex` refuses flex for a model with none). A local server (base_url on
localhost, or a llama.cpp / Ollama / vLLM / llama-cpp-python profile, set or found by asking the
server, whatever its host) is not priced (cost NULL, shown "not priced", never a misleading 0)
unless prices are set or `price_as_model` names a listed model (the demo's simulator is priced
as the model it names, labelled simulated). Unknown models cost NULL, with
one warning naming LLMResource's price fields. The data is the snapshot
shipped with the package: nothing is downloaded at run time (upgrade genai-prices for new data).
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import genai_prices

from ..engine.engine import ChatResult
from ..engine.errors import BatchLLMError

log = logging.getLogger(__name__)

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "host.docker.internal"})
LOCAL_PROVIDERS = frozenset(
    {"llama.cpp", "llamacpp", "ollama", "vllm", "llama-cpp-python", "lmstudio", "local"}
)
# Our provider profiles -> genai-prices provider ids (else the library guesses from the model).
_PROVIDER_IDS = {"openai": "openai", "azure": "azure", "gemini": "google", "google": "google"}
_UNKNOWN_HINT = (
    "Set price_input_per_1m and price_output_per_1m (and price_cached_input_per_1m) on the LLM "
    "resource to record costs."
)
_warned: set[str] = set()
# OpenAI's and Azure OpenAI's batch list price is half the live one; so is flex processing's,
# which is "priced at Batch API rates" (https://developers.openai.com/api/docs/guides/
# flex-processing): configured (live) prices are scaled by it for batch and flex rows.
BATCH_PRICE_FACTOR = 0.5
_BATCH = {"processing": "batch"}
_FLEX = {"service_tier": "flex"}


@dataclass(frozen=True)
class Price:
    """How a model's requests are priced: USD per 1M tokens, from the library or set by hand."""

    model: str
    source: str  # "genai-prices", "configured" or "simulated" (priced as `as_model`)
    input_per_1m: float
    output_per_1m: float
    cached_input_per_1m: float
    provider_id: str | None = None
    batch: bool = False
    as_model: str | None = None
    # (input, output, cached input) for rows answered at the flex tier; None: no flex price.
    flex: tuple[float, float, float] | None = None

    @property
    def label(self) -> str:
        """How the costs were priced, as the metadata shows it."""
        if self.source == "simulated":
            return f"simulated at {self.as_model} list prices"
        if self.source == "configured":
            return "configured prices (LLMResource price_*_per_1m)"
        return f"{self.model} list prices (genai-prices)"


def pricing_label(price: Price | None) -> str:
    return f"pricing: {price.label}" if price is not None else "pricing: not priced"


def is_local(base_url: str | None, provider: str | None = None) -> bool:
    """A server on this machine (or a self-hosted profile): nobody bills per token."""
    if provider and provider.lower() in LOCAL_PROVIDERS:
        return True
    host = urlsplit(base_url).hostname if base_url else None
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback or host == "0.0.0.0"
    except ValueError:
        return host in LOCAL_HOSTS or host.endswith(".localhost")


def _library_rates(
    model: str, provider_id: str | None, context: dict[str, str] | None
) -> tuple[float, float, float] | None:
    """(input, output, cached input) USD per 1M tokens as genai-prices lists them for a
    request in `context` (the Batch API, a service tier), or None."""
    try:
        rates = []
        for usage in (
            genai_prices.Usage(input_tokens=1_000_000),
            genai_prices.Usage(output_tokens=1_000_000),
            genai_prices.Usage(input_tokens=1_000_000, cache_read_tokens=1_000_000),
        ):
            calc = genai_prices.calc_price(
                usage, model, provider_id=provider_id, price_context=context
            )
            rates.append(float(calc.total_price))
    except LookupError:
        return None
    return rates[0], rates[1], rates[2]


def _flex_rates(model: str, provider_id: str | None) -> tuple[float, float, float] | None:
    """The model's flex rates, or None when genai-prices lists none (it then gives the standard
    rates for a flex context: a flex price is always below them)."""
    flex = _library_rates(model, provider_id, _FLEX)
    return flex if flex is not None and flex != _library_rates(model, provider_id, None) else None


def price_for_resource(
    llm: Any, model: str, *, batch: bool = False, logger: Any = None, as_itself: bool = False
) -> Price | None:
    """`price_for` with an LLMResource's price overrides, endpoint and provider (the setting,
    else what the server said it is when the engine opened); with `price_as_model`, the list
    price of that model instead (a stand-in such as the simulator), or with `as_itself` the
    list price of `model` (an embedding model on a stand-in that plays a chat model)."""
    as_model = getattr(llm, "price_as_model", None)
    as_model = model if as_model and as_itself else as_model
    if as_model and llm.price_input_per_1m is None:
        context = _BATCH if batch else None
        rates = _library_rates(as_model, "openai", context) or _library_rates(
            as_model, None, context
        )
        if rates is not None:
            flex = _flex_rates(as_model, "openai")
            return Price(model, "simulated", *rates, batch=batch, as_model=as_model, flex=flex)
    return price_for(
        model,
        input_override=llm.price_input_per_1m,
        output_override=llm.price_output_per_1m,
        cached_input_override=llm.price_cached_input_per_1m,
        base_url=llm.base_url,
        provider=getattr(llm, "provider", None) or getattr(llm, "server_kind", None),
        batch=batch,
        logger=logger,
    )


def price_for(
    model: str,
    *,
    input_override: float | None = None,
    output_override: float | None = None,
    cached_input_override: float | None = None,
    base_url: str | None = None,
    provider: str | None = None,
    batch: bool = False,
    logger: Any = None,
) -> Price | None:
    """How `model`'s requests are priced, or None when unknown (then no cost is guessed).

    Explicit prices win; then an explicit provider profile's list price (a local gateway to a
    hosted provider is billed); then None for a local server (nobody bills it per token, and a
    0 would read as a real cost); then the library's price by model.
    """
    configured = input_override is not None and output_override is not None
    if configured:
        cached = cached_input_override if cached_input_override is not None else input_override
        f = BATCH_PRICE_FACTOR
        flex = (input_override * f, output_override * f, cached * f)
        return Price(model, "configured", input_override, output_override, cached, flex=flex)
    hosted_profile = provider is not None and provider.lower() in _PROVIDER_IDS
    if is_local(base_url, provider) and not hosted_profile:
        return None
    provider_id = _PROVIDER_IDS.get((provider or "").lower()) or (
        "openai" if base_url is None or "api.openai.com" in base_url else None
    )
    rates = _library_rates(model, provider_id, _BATCH if batch else None)
    if rates is None:
        if model not in _warned:
            _warned.add(model)
            (logger or log).warning(
                f"No price known for model {model!r}: cost_usd stays NULL. " + _UNKNOWN_HINT
            )
        return None
    inp, out, cached = rates
    return Price(
        model,
        "genai-prices",
        inp if input_override is None else input_override,
        out if output_override is None else output_override,
        cached if cached_input_override is None else cached_input_override,
        provider_id=provider_id,
        batch=batch,
        flex=_flex_rates(model, provider_id),
    )


def cost_usd(
    price: Price | None,
    prompt: int | None,
    completion: int | None,
    *,
    cached: int | None = None,
    tier: str | None = None,
) -> float | None:
    """USD of one answer. Cached prompt tokens are billed at the cached rate; reasoning tokens
    are part of `completion` (OpenAI counts them there) and billed as output. `tier`: the tier
    the answer says served it; "flex" is billed at the flex rates."""
    if price is None or prompt is None:
        return None
    inp, out, cache = price.input_per_1m, price.output_per_1m, price.cached_input_per_1m
    if tier == "flex" and price.flex is not None:
        inp, out, cache = price.flex
    hit = min(max(cached or 0, 0), prompt)
    return ((prompt - hit) * inp + hit * cache + (completion or 0) * out) / 1_000_000


def result_cost(price: Price | None, r: ChatResult) -> float | None:
    """`cost_usd` of an engine result, at the rates of the tier that answered it."""
    return cost_usd(
        price, r.prompt_tokens, r.completion_tokens, cached=r.cached_tokens, tier=r.service_tier
    )


def check_flex(llm: Any, model: str, params: dict[str, Any], logger: Any = None) -> None:
    """Flex is sent only to a model with a flex price (OpenAI lists the models that have
    flex processing on its pricing page, which genai-prices follows): one it lists without a
    flex price is refused before anything is sent; one it does not know is warned about (the
    provider answers 400 if it has no flex tier; its flex rows cost the configured prices at
    the batch factor, or NULL)."""
    if params.get("service_tier") != "flex":
        return
    priced = getattr(llm, "price_as_model", None) or model
    provider = getattr(llm, "provider", None) or getattr(llm, "server_kind", None)
    provider_id = _PROVIDER_IDS.get((provider or "").lower(), "openai")
    if _flex_rates(priced, provider_id) is not None:
        return
    if _library_rates(priced, provider_id, None) is None:
        (logger or log).warning(
            f"Flex processing for {priced!r} cannot be checked (genai-prices does not list the "
            "model): requests are sent with service_tier 'flex' as asked."
        )
        return
    raise BatchLLMError(
        description=f"service_tier 'flex' is not offered for {priced!r}: genai-prices lists no "
        "flex price for it (OpenAI offers flex processing on the models its pricing page lists "
        "with flex prices, e.g. gpt-5, gpt-5-mini, o3, o4-mini). Remove service_tier from "
        "params, or choose such a model. Nothing was sent."
    )


def served_model(
    configured: str, answered: str | None, seen: str | None, logger: Any
) -> str | None:
    """The model named in the answers; warns once when it is not the configured one (nor a dated
    snapshot of it), since the cost was priced for the configured model: the first time the
    answers depart from it, not again when they name a third model."""
    if not answered or answered == seen:
        return seen or answered
    if not _same_model(answered, configured) and (seen is None or _same_model(seen, configured)):
        (logger or log).warning(
            f"The provider answered with model {answered!r}, not the configured {configured!r}: "
            "rows record the served model; costs use the configured model's price."
        )
    return answered


def _same_model(answered: str, configured: str) -> bool:
    return answered == configured or answered.startswith(configured + "-")
