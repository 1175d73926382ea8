"""Which server answers at a base URL: asked once, when an engine opens, when nobody said.

A few cheap GETs, at once, each bounded by PROBE_TIMEOUT_S and PROBE_MAX_BYTES; what answers
decides the profile (concurrency, timeout, pricing) and the structured-output form. What each
server answers, from its own docs and source:
- vLLM: `/v1/models` entries are ModelCards with `owned_by: "vllm"` and `max_model_len`
  (vllm/entrypoints/openai/protocol.py, ModelCard); `GET /version` answers `{"version": ...}`
  (vllm/entrypoints/serve/instrumentator/basic.py, show_version). An llm-d gateway passes both
  through to its vLLM pods.
- llama.cpp's llama-server: `/v1/models` entries say `owned_by: "llamacpp"` (with `meta.n_ctx_train`,
  the training context); `GET /props` answers `default_generation_settings` whose `n_ctx` is the
  context a request gets, and `total_slots` (tools/server/README.md, "GET /props"). Its
  `/health` (`{"status": "ok"}`) says nothing another server would not, so it is not asked.
- Ollama: `GET /api/version` answers `{"version": "0.12.6"}` (docs.ollama.com/api-reference/
  get-version); its `/v1/models` says only the model's namespace in `owned_by` ("library";
  openai/openai.go, ToListCompletion).
- llama-cpp-python: `/v1/models` entries say `owned_by: "me"` with a `permissions` list, and
  nothing else of these routes exists (llama_cpp/server/app.py, get_models).
- This package's simulator says `owned_by: "simulator"`: generic (it reads every form), known,
  so the demo's runs are not warned about it.
The paths other than /v1/models are at the server's root: the base URL less its `/v1`.
A GET that fails, times out, is not 200, is too large or is not JSON counts as no answer, so a
server that answers nothing is `generic` (with one warning), never an error.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from . import _constants as C
from .profiles import context_window_from_models, profile_for

log = logging.getLogger(__name__)

KINDS = ("vllm", "llamacpp", "llama-cpp-python", "ollama", "generic")
# The structured-output form (structured.py) each kind honours: llama-cpp-python takes
# llama.cpp's `json_object` + `schema` (its README, "JSON Schema Mode"); Ollama reads
# `response_format` json_schema (openai/openai.go, ResponseFormat).
FORMS = {
    "vllm": "vllm",
    "llamacpp": "llamacpp",
    "llama-cpp-python": "llamacpp",
    "ollama": "ollama",
    "generic": "generic",
}


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What a server said of itself: its kind, why, the model's context window, its models."""

    kind: str
    reason: str
    context_window: int | None = None
    models: tuple[str, ...] = ()
    known: bool = True  # False: nothing identified it (generic, warned about)

    @property
    def form(self) -> str:
        return FORMS[self.kind]

    def serves(self, model: str) -> bool:
        """The server lists `model` (Ollama's `name` means `name:latest`), or lists nothing."""
        return not self.models or model in self.models or f"{model}:latest" in self.models


def server_root(base_url: str) -> str:
    """The server's root: the base URL less a trailing /v1."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


async def probe_server(
    *, base_url: str, model: str, headers: dict[str, str], timeout_s: float = C.PROBE_TIMEOUT_S
) -> ServerInfo:
    """Ask the server at `base_url` what it is, log what was chosen and why, and warn when it
    does not list `model` (a llama.cpp server answers under any name, echoing it back)."""
    root = server_root(base_url)
    urls = {
        "models": base_url.rstrip("/") + "/models",
        "props": root + "/props",
        "ollama": root + "/api/version",
        "version": root + "/version",
    }
    async with aiohttp.ClientSession(headers=headers) as session:
        answers = await asyncio.gather(*(_get_json(session, u, timeout_s) for u in urls.values()))
    info = identify(dict(zip(urls, answers, strict=True)), model)
    where = display_url(base_url)
    if not info.known:
        log.warning(
            "Could not tell which server answers at %s (%s): using the generic profile and "
            "structured-output form. Set LLMResource.provider (vllm, llamacpp, ollama, "
            "llama-cpp-python, openai, ...) to choose.",
            where,
            info.reason,
        )
    else:
        profile = profile_for(info.kind, base_url)
        log.info(
            "The server at %s is %s (%s): %s profile (%d requests in flight, %.0f s timeout "
            "unless set), %s structured-output form, context window %s.",
            where,
            info.kind,
            info.reason,
            profile.name,
            profile.max_concurrency,
            profile.request_timeout_s,
            info.form,
            info.context_window or "not reported",
        )
    if not info.serves(model):
        log.warning(
            "The server at %s serves %s, not the configured model %r: its answers are that "
            "model's (a llama.cpp or llama-cpp-python server answers under any name and echoes "
            "it back). Set the LLM resource's model to the served name.",
            where,
            ", ".join(repr(m) for m in info.models[:5]),
            model,
        )
    return info


def identify(answers: dict[str, Any], model: str) -> ServerInfo:
    """The server kind from the probe's answers (pure): `models` (/v1/models), `props`
    (/props), `ollama` (/api/version), `version` (/version); None where nothing answered."""
    entries = _entries(answers.get("models"))
    owners = {o for e in entries if isinstance(o := e.get("owned_by"), str)}
    ids = tuple(e["id"] for e in entries if isinstance(e.get("id"), str))
    window = _window(context_window_from_models(answers.get("models"), model))
    settings = _dict(_dict(answers.get("props")).get("default_generation_settings"))
    if "vllm" in owners:
        return ServerInfo("vllm", "its /v1/models says owned_by 'vllm'", window, ids)
    if "llamacpp" in owners or settings:
        why = "its /props has default_generation_settings" if settings else "owned_by 'llamacpp'"
        return ServerInfo("llamacpp", why, _window(settings.get("n_ctx")) or window, ids)
    if _version(answers.get("ollama")):
        return ServerInfo("ollama", "it answers /api/version as Ollama does", window, ids)
    if any(e.get("owned_by") == "me" and isinstance(e.get("permissions"), list) for e in entries):
        return ServerInfo("llama-cpp-python", "its /v1/models says owned_by 'me'", window, ids)
    if _version(answers.get("version")):
        return ServerInfo("vllm", "it answers /version as vLLM does", window, ids)
    if "simulator" in owners:
        return ServerInfo("generic", "it is this package's simulator", window, ids)
    said = "its /v1/models names no known server" if entries else "no probe was answered"
    return ServerInfo("generic", said, window, ids, known=False)


async def discover_context_window(
    *, base_url: str, model: str, headers: dict[str, str], timeout_s: float = C.PROBE_TIMEOUT_S
) -> int | None:
    """The model's context window from /v1/models alone (a server whose kind was set)."""
    async with aiohttp.ClientSession(headers=headers) as session:
        payload = await _get_json(session, base_url.rstrip("/") + "/models", timeout_s)
    return _window(context_window_from_models(payload, model))


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Any:
    """The JSON a GET answers with 200, or None (error, timeout, redirect, too large, not JSON)."""
    try:
        async with asyncio.timeout(timeout_s):  # connect, headers and body together
            async with session.get(url, allow_redirects=False) as resp:
                if resp.status != 200:
                    return None
                body = bytearray()
                async for chunk in resp.content.iter_chunked(65_536):
                    body += chunk
                    if len(body) > C.PROBE_MAX_BYTES:
                        log.debug("%s answered over %d bytes: ignored", display_url(url), len(body))
                        return None
        return json.loads(bytes(body))
    except (aiohttp.ClientError, TimeoutError, ValueError, RecursionError) as exc:
        log.debug("%s: no answer (%s)", display_url(url), type(exc).__name__)
        return None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _entries(payload: Any) -> list[dict[str, Any]]:
    data = _dict(payload).get("data")
    return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []


def _window(value: Any) -> int | None:
    """A context window a server reports: a whole number of tokens, within reason."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if 0 < value <= C.PROBE_MAX_CONTEXT_WINDOW else None
    return None


def _version(payload: Any) -> bool:
    """An answer shaped like vLLM's /version or Ollama's /api/version: {"version": "x.y.z"}."""
    version = _dict(payload).get("version")
    return isinstance(version, str) and 0 < len(version) <= 64


def display_url(url: str) -> str:
    """The URL without credentials or query (for logs)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if parts.port:
            netloc += f":{parts.port}"
    except ValueError:  # a port that is not a number
        return "<unparseable URL>"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
