"""What a request cost: USD per 1M input / output tokens of well-known models.

List prices of standard (not batch, not cached) processing, as published by OpenAI, Azure
OpenAI (global deployments) and Google in 2025-2026. Prices change: override them per model
with LLMResource.price_input_per_1m / price_output_per_1m.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

PRICES_PER_1M: dict[str, tuple[float, float]] = {
    # OpenAI and Azure OpenAI
    "gpt-5": (1.25, 10.00),
    "gpt-5-mini": (0.25, 2.00),
    "gpt-5-nano": (0.05, 0.40),
    "gpt-4.1": (2.00, 8.00),
    "gpt-4.1-mini": (0.40, 1.60),
    "gpt-4.1-nano": (0.10, 0.40),
    "gpt-4o": (2.50, 10.00),
    "gpt-4o-mini": (0.15, 0.60),
    "o3": (2.00, 8.00),
    "o4-mini": (1.10, 4.40),
    "o3-mini": (1.10, 4.40),
    "gpt-3.5-turbo": (0.50, 1.50),
    # Google Gemini (OpenAI-compatible endpoint), prompts up to 200k tokens
    "gemini-2.5-pro": (1.25, 10.00),
    "gemini-2.5-flash": (0.30, 2.50),
    "gemini-2.5-flash-lite": (0.10, 0.40),
    "gemini-2.0-flash": (0.10, 0.40),
}

_warned: set[str] = set()


def price_for(
    model: str, *, input_override: float | None = None, output_override: float | None = None
) -> tuple[float, float] | None:
    """(input, output) USD per 1M tokens, or None when unknown (then no cost is guessed)."""
    if input_override is not None and output_override is not None:
        return input_override, output_override
    best = max(
        (m for m in PRICES_PER_1M if model == m or model.startswith(m + "-")), key=len, default=None
    )
    if best is None:
        if model not in _warned:
            _warned.add(model)
            log.warning(
                "No price known for model %r: cost_usd is left unknown. Set "
                "price_input_per_1m and price_output_per_1m on the LLM resource.",
                model,
            )
        return None
    base_in, base_out = PRICES_PER_1M[best]
    return (
        base_in if input_override is None else input_override,
        base_out if output_override is None else output_override,
    )


def cost_usd(price: tuple[float, float] | None, prompt: int | None, completion: int | None):
    if price is None or prompt is None:
        return None
    return (prompt * price[0] + (completion or 0) * price[1]) / 1_000_000
