"""The simulator's settings: one dataclass, changeable at run time through POST /admin/config."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .counting import COUNTINGS
from .kinds import SERVER_KINDS
from .limits import ENFORCEMENTS
from .structured import TYPED_MODES

LIMIT_HEADERS = ("per_minute", "capacity", "none", "ietf")
RETRY_AFTER_STYLES = ("both", "seconds", "ms")
USAGE_SHAPES = ("openai", "input_output", "none")
# Settings whose change rebuilds the limits (and so empties them, like a fresh key).
LIMIT_SETTINGS = frozenset(
    {"rpm", "tpm", "bucket_s", "seed", "enforcement", "window_s", "quantum_s"}
)


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
    # How a small model answers a schema request (simulator/structured.py): obeys; ignores_schema
    # (free text, or the schema copied back when the prompt states it); out_of_range (valid JSON,
    # numbers outside the schema's bounds unless the prompt states them).
    typed_mode: str = "obeys"

    # How real providers differ (simulator/limits.py): enforcement bucket | fixed_window |
    # sliding_window | quantized | azure; window_s for the windows, quantum_s for quantized.
    enforcement: str = "bucket"
    window_s: float = 10.0
    quantum_s: float = 1.0
    # How the provider counts a prompt (simulator/counting.py): tiktoken or chars4 (a quarter
    # of the messages' JSON), then each prompt's count off by up to +-count_noise (0.1: 10 %),
    # the same for the same prompt and seed.
    counting: str = "tiktoken"
    count_noise: float = 0.0
    usage_shape: str = "openai"  # or "input_output", or "none" (no usage block)
    retry_after: str = "both"  # retry-after-ms + whole seconds; "seconds" (rounded up); "ms"
    # or "capacity" (the bucket's), "none", or "ietf" (a gateway's RateLimit-*: responses.py)
    limit_header: str = "per_minute"
    rate_headers: bool = True  # x-ratelimit-remaining-* / -reset-* on every answer
    reasoning: bool = False  # reject max_tokens (400 unsupported_parameter), as gpt-5 / o-series
    insufficient_quota: bool = False  # every request: 429 insufficient_quota
    fail_param: str | None = None  # a deterministic 500 for every body that has this parameter
    # Which real server it answers as (simulator/kinds.py): its probe routes, its one
    # structured-output form. served_model: the one model it holds (one of `models`), answered
    # under any name the request gives, as llama.cpp and llama-cpp-python do.
    server_kind: str = "simulator"
    served_model: str | None = None
    # A self-hosted server (simulator/slots.py): this many requests decoded at once, the rest
    # queued inside the server (0: no limit); each sequence's per-token time grows by
    # decode_slowdown per other sequence in the batch.
    decode_slots: int = 0
    decode_slowdown: float = 0.0
    # Flex processing (simulator/tiers.py): the fraction of requests sent with service_tier
    # "flex" refused with OpenAI's 429 Resource Unavailable (1.0: a shortage that never ends).
    flex_unavailable: float = 0.0
    # POST /v1/embeddings (simulator/embeddings.py): OpenAI's documented limits, lowerable.
    embedding_max_inputs: int = 2048
    embedding_max_input_tokens: int = 8192
    embedding_max_request_tokens: int = 300_000


_CHOICES = {
    "enforcement": ENFORCEMENTS,
    "counting": COUNTINGS,
    "limit_header": LIMIT_HEADERS,
    "retry_after": RETRY_AFTER_STYLES,
    "usage_shape": USAGE_SHAPES,
    "typed_mode": TYPED_MODES,
    "server_kind": SERVER_KINDS,
}


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def check(config: SimConfig) -> SimConfig:
    """The config itself, or ValueError naming the first setting a provider could not have."""
    for name, allowed in _CHOICES.items():
        if getattr(config, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {getattr(config, name)!r}")
    for name in ("rpm", "tpm"):
        value = getattr(config, name)
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name} must be a whole number >= 1 or null, got {value!r}")
    for name in ("bucket_s", "window_s", "quantum_s"):
        value = getattr(config, name)
        if not (_positive(value) and math.isfinite(value) and value <= 3600):
            raise ValueError(f"{name} must be a number of seconds in (0, 3600], got {value!r}")
    if config.served_model is not None and config.served_model not in config.models:
        raise ValueError(f"served_model must be one of models, got {config.served_model!r}")
    slots = config.decode_slots
    if not (isinstance(slots, int) and not isinstance(slots, bool) and 0 <= slots <= 100_000):
        raise ValueError(f"decode_slots must be a whole number in [0, 100000], got {slots!r}")
    slowdown = config.decode_slowdown
    if not (isinstance(slowdown, int | float) and 0 <= slowdown <= 1):  # NaN fails too
        raise ValueError(f"decode_slowdown must be a fraction in [0, 1], got {slowdown!r}")
    flex = config.flex_unavailable
    if not (isinstance(flex, int | float) and not isinstance(flex, bool) and 0 <= flex <= 1):
        raise ValueError(f"flex_unavailable must be a fraction in [0, 1], got {flex!r}")
    for name in (
        "embedding_max_inputs",
        "embedding_max_input_tokens",
        "embedding_max_request_tokens",
    ):
        value = getattr(config, name)
        if not (type(value) is int and value >= 1):
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    noise = config.count_noise
    if not (isinstance(noise, int | float) and 0 <= noise < 1):
        raise ValueError(f"count_noise must be a fraction in [0, 1), got {noise!r}")
    return config


def updated(config: SimConfig, updates: Any) -> SimConfig:
    """A copy of `config` with `updates` (a JSON object), checked; ValueError names a bad one."""
    if not isinstance(updates, dict):
        raise ValueError("settings must be a JSON object")
    unknown = set(updates) - {f.name for f in dataclasses.fields(SimConfig)}
    if unknown:
        raise ValueError(f"unknown settings: {sorted(unknown)}")
    return check(dataclasses.replace(config, **updates))
