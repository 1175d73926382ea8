"""Server kinds: the simulator answering as a real self-hosted server does (SimConfig.server_kind).

Each kind answers the routes a client probes the way that server does, 404 for the others
(engine/server_probe.py cites each server's docs), and honours only the structured-output form
that server reads; a request in another form gets what a small model does when nothing
constrains it and the schema is in front of it: the schema copied back.
- simulator (the default): /v1/models with owned_by "simulator" and max_model_len; every form.
- openai: /v1/models with owned_by "system"; response_format json_schema, or json_object with
  the schema in the prompt.
- vllm: owned_by "vllm" and max_model_len, GET /version, GET /health (empty 200);
  `structured_outputs` / `guided_json`.
- llamacpp: owned_by "llamacpp" with meta.n_ctx_train, GET /props (default_generation_settings
  with n_ctx, total_slots), GET /health {"status": "ok"}; response_format json_object + schema.
- llama-cpp-python: owned_by "me" with a permissions list, nothing else; json_object + schema.
- ollama: owned_by "library", GET /api/version; response_format json_schema.
"""

from __future__ import annotations

import json
import time
from typing import Any

SERVER_KINDS = ("simulator", "openai", "vllm", "llamacpp", "llama-cpp-python", "ollama")
# The probe routes at the server's root (/v1/models is the models route).
ROOT_ROUTES = ("/version", "/props", "/health", "/api/version")
# Kinds that name the request's model in their answers (llama.cpp's server sets the answer's
# model from the request's, llama-cpp-python and Ollama likewise) when they hold one served
# model; the others name the served one, as a gateway that maps names does.
ECHOES_MODEL = frozenset({"llamacpp", "llama-cpp-python", "ollama"})
_HONOURS = {
    "simulator": None,  # every form
    "openai": {"json_schema", "prompt"},
    "vllm": {"structured_outputs", "guided_json"},
    "llamacpp": {"json_object_schema"},
    "llama-cpp-python": {"json_object_schema"},
    "ollama": {"json_schema"},
}
_VERSIONS = {"vllm": "0.10.1", "ollama": "0.12.6"}


def form_of(body: dict[str, Any]) -> str | None:
    """The structured-output form a request body uses, if any."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return "json_schema"
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return "json_object_schema" if isinstance(fmt.get("schema"), dict) else "prompt"
    if isinstance(body.get("structured_outputs"), dict):
        return "structured_outputs"
    return "guided_json" if body.get("guided_json") is not None else None


def honours(kind: str, form: str | None) -> bool:
    allowed = _HONOURS[kind]
    return form is None or allowed is None or form in allowed


def schema_copied_back(schema: dict[str, Any]) -> str:
    """What an unconstrained small model answers with a schema in front of it."""
    return json.dumps(schema, separators=(",", ":"))


def served_models(config: Any) -> dict[str, int]:
    """The models the server holds: the one `served_model`, else every configured one."""
    served = config.served_model
    return {served: config.models[served]} if served else dict(config.models)


def answer_model(config: Any, requested: str) -> str:
    """The model an answer names: the requested one, unless the server holds one model and
    says its own name (vLLM, Ollama) rather than echoing the request's (llama.cpp)."""
    if config.served_model and config.server_kind not in ECHOES_MODEL:
        return config.served_model
    return requested


def models_body(kind: str, models: dict[str, int]) -> dict[str, Any]:
    """GET /v1/models as `kind` answers it."""
    created = int(time.time())

    def entry(model: str, window: int) -> dict[str, Any]:
        base = {"id": model, "object": "model", "created": created}
        if kind == "vllm":
            vllm = {"root": model, "parent": None, "max_model_len": window, "permission": []}
            return base | {"owned_by": "vllm"} | vllm
        if kind == "llamacpp":
            meta = {"vocab_type": 2, "n_vocab": 49152, "n_ctx_train": window * 4}
            return base | {"owned_by": "llamacpp", "meta": meta}
        if kind == "llama-cpp-python":
            return {"id": model, "object": "model", "owned_by": "me", "permissions": []}
        if kind == "ollama":
            return base | {"owned_by": "library"}
        if kind == "openai":
            return base | {"owned_by": "system"}
        return base | {"owned_by": "simulator", "max_model_len": window}

    return {"object": "list", "data": [entry(m, n) for m, n in models.items()]}


def root_route(kind: str, path: str, models: dict[str, int]) -> tuple[int, Any]:
    """(status, JSON body or None for an empty one) of GET `path` at the root, as `kind`."""
    window = next(iter(models.values()), 0)
    if kind == "vllm" and path == "/version":
        return 200, {"version": _VERSIONS["vllm"]}
    if kind == "vllm" and path == "/health":
        return 200, None
    if kind == "llamacpp" and path == "/health":
        return 200, {"status": "ok"}
    if kind == "llamacpp" and path == "/props":
        settings = {"id": 0, "id_task": -1, "n_ctx": window, "is_processing": False}
        return 200, {
            "default_generation_settings": settings,
            "total_slots": 1,
            "model_path": f"/models/{next(iter(models), 'model')}.gguf",
            "modalities": {"vision": False},
            "build_info": "b6000-simulator",
        }
    if kind == "ollama" and path == "/api/version":
        return 200, {"version": _VERSIONS["ollama"]}
    if kind == "llama-cpp-python":
        return 404, {"detail": "Not Found"}  # FastAPI's
    return 404, {"error": {"message": f"{path} not found", "type": "not_found_error"}}
