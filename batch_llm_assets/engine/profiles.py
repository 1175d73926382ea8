"""Provider profiles: what differs between OpenAI-compatible servers, in one place.

A profile says which token-limit parameter a model takes, how many requests a server handles at
once and how long an answer may take. It is set with `LLMResource.provider`, else known from a
hosted API's URL (api.openai.com, Azure, Gemini); any other server is asked what it is when an
engine opens (server_probe.py): its port says nothing (a llama.cpp server on port 8000 is
still llama.cpp).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

PROVIDERS = (
    "openai",
    "azure",
    "gemini",
    "vllm",
    "llamacpp",
    "ollama",
    "llama-cpp-python",
    "generic",
)
# Names that share a profile: Ollama and llama-cpp-python run one model on local hardware, as
# llama.cpp's server does.
_ALIASES = {
    "ollama": "llamacpp",
    "llama.cpp": "llamacpp",
    "llama-cpp-python": "llamacpp",
    "llama_cpp_python": "llamacpp",
}


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    max_concurrency: int  # requests in flight per process when the resource sets none
    request_timeout_s: float
    hosted: bool  # a hosted service with published models (else ask the server about them)


PROFILES = {
    "openai": Profile("openai", 64, 60.0, True),
    "azure": Profile("azure", 64, 60.0, True),
    "gemini": Profile("gemini", 32, 120.0, True),
    "vllm": Profile("vllm", 64, 300.0, False),
    "llamacpp": Profile("llamacpp", 4, 600.0, False),
    "generic": Profile("generic", 64, 60.0, False),
}


def detect_provider(base_url: str, *, api_version: str | None = None) -> str:
    """The hosted API a base URL names (openai, azure, gemini); `generic` for any other server,
    which only the server itself can identify (server_probe.py)."""
    if api_version:
        return "azure"
    host = (urlparse(base_url).hostname or "").lower()
    if host.endswith("openai.azure.com") or host.endswith("cognitiveservices.azure.com"):
        return "azure"
    if host == "api.openai.com":
        return "openai"
    if host == "generativelanguage.googleapis.com" or host.endswith("aiplatform.googleapis.com"):
        return "gemini"
    return "generic"


def profile_for(provider: str | None, base_url: str, *, api_version: str | None = None) -> Profile:
    name = (provider or detect_provider(base_url, api_version=api_version)).lower()
    name = _ALIASES.get(name, name)
    if name not in PROFILES:
        raise ValueError(f"unknown provider {name!r}; expected one of {', '.join(PROVIDERS)}")
    return PROFILES[name]


_REASONING_PREFIXES = ("gpt-5", "o1", "o3", "o4")


def token_param_for(model: str) -> str:
    """OpenAI's reasoning models (gpt-5*, o1*, o3*, o4*) reject max_tokens."""
    bare = model.rsplit("/", 1)[-1].lower()
    return "max_completion_tokens" if bare.startswith(_REASONING_PREFIXES) else "max_tokens"


_TOKEN_PARAMS = ("max_tokens", "max_completion_tokens")


class TokenParam:
    """The parameter one engine's model takes for the answer budget (never both): chosen by
    the model's name, switched once if the model rejects it (`switched` is recorded)."""

    def __init__(self, model: str, name: str | None = None) -> None:
        self.model = model
        self.name = name or token_param_for(model)
        self.switched = False

    def set(self, body: dict[str, Any], max_tokens: int) -> None:
        for other in _TOKEN_PARAMS:
            body.pop(other, None)
        body[self.name] = max_tokens

    def switch(self, rejected: str | None) -> bool:
        """The model rejected parameter `rejected`: if it is ours, take the other one, once."""
        if self.switched or rejected != self.name:
            return False
        old, self.switched = self.name, True
        self.name = "max_completion_tokens" if old == "max_tokens" else "max_tokens"
        log.warning(
            "Model %r rejects %s; sending %s instead (set it in params to skip this).",
            self.model,
            old,
            self.name,
        )
        return True


_WINDOW_FIELDS = (
    "max_model_len",
    "context_length",
    "n_ctx",
    "context_window",
    "max_context_length",
)


def context_window_from_models(payload: Any, model: str) -> int | None:
    """The context window a /v1/models answer gives for `model` (vLLM, llama.cpp, Ollama...)."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        return None
    entries = [d for d in data if isinstance(d, dict)]
    match = [d for d in entries if d.get("id") == model] or (entries if len(entries) == 1 else [])
    for entry in match:
        for source in (entry, entry.get("meta") or {}, entry.get("details") or {}):
            if not isinstance(source, dict):
                continue
            for key in _WINDOW_FIELDS:
                value = source.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None
