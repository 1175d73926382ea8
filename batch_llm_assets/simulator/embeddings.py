"""The simulator's embeddings: POST /v1/embeddings (and Azure's deployment form), and the answer
to an embeddings line of a batch (simulator/batch.py).

What OpenAI documents for the endpoint (the `input` field of openai-python's
types/embedding_create_params.py, from the API reference): input is a string or an array of
strings, none empty, none over 8192 tokens, at most 2048 in an array, and "all embedding models
enforce a maximum of 300,000 tokens summed across all inputs in a single request"; `dimensions`
shortens the vector ("only supported in text-embedding-3 and later models"); `encoding_format`
is float or base64 (little-endian float32, as the SDK decodes it: lib/_parsing/_embeddings.py).
Each breach is a 400 for the whole request with the message clients have quoted from OpenAI
("Requested 453357 tokens, max 300000 tokens per request", code max_tokens_per_request;
"Invalid 'input': maximum context length is 8192 tokens."; "Too many inputs. The max number of
inputs is 2048."). The limits are settings (SimConfig.embedding_*), so tests can lower them.

The key, the rpm/tpm limits, the faults and the latency are the chat route's: a request costs one
request and the sum of its inputs' tokens, which its usage reports as prompt_tokens.

Vectors are deterministic unit vectors: the normalised sum of one pseudo-random vector per word
of the text, seeded by the model and the word, so texts that share words are similar and a
similarity query on them means something. `dimensions` keeps the first ones and normalises
again, as OpenAI's shortening does (openai.com/index/new-embedding-models-and-api-updates).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from aiohttp import web

from ..engine.tokens import count_text_tokens
from .chat import admit, headers
from .counting import chars4_tokens, noise_factor

if TYPE_CHECKING:
    from .server import Simulator

ENDPOINT = "/v1/embeddings"
# Model -> its native dimensions (OpenAI's model pages).
EMBEDDING_MODELS = {
    "text-embedding-3-small": 1536,
    "text-embedding-3-large": 3072,
    "text-embedding-ada-002": 1536,
}
SHORTENABLE = ("text-embedding-3",)  # the models that take `dimensions`
ENCODINGS = ("float", "base64")
_WORD = re.compile(r"\w+")
_INVALID_INPUT = (
    "'$.input' is invalid. Please check the API reference: "
    "https://platform.openai.com/docs/api-reference."
)


class Refused(Exception):
    """A request the provider refuses: status, message, type, code, param."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": None, "code": self.code}
        }


def _bad(message: str, code: str | None = None) -> Refused:
    return Refused(400, message, "invalid_request_error", code)


def register(sim: Simulator, app: web.Application) -> None:
    async def route(request: web.Request) -> web.StreamResponse:
        return await embeddings(sim, request)

    app.router.add_post(ENDPOINT, route)
    app.router.add_post("/openai/deployments/{deployment}/embeddings", route)


def listed(config: Any) -> dict[str, int]:
    """The embedding models GET /v1/models lists (none for a server holding one model), with
    their input limit as the window: what a client probing the server reads."""
    return (
        {}
        if config.served_model
        else dict.fromkeys(EMBEDDING_MODELS, config.embedding_max_input_tokens)
    )


# -- the request ---------------------------------------------------------------------------------
def parse(config: Any, body: Any, model: Any) -> tuple[list[str], str, int, int, str]:
    """(inputs, model, native dimensions, dimensions, encoding_format), or Refused."""
    if not isinstance(body, dict) or not isinstance(model, str) or "input" not in body:
        raise _bad("request body must be JSON with model and input")
    raw = body["input"]
    inputs = [raw] if isinstance(raw, str) else raw
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) for t in inputs):
        raise _bad(_INVALID_INPUT)  # token arrays are valid at OpenAI; the simulator takes text
    if any(t == "" for t in inputs):
        raise _bad(_INVALID_INPUT)
    if len(inputs) > config.embedding_max_inputs:
        raise _bad(f"Too many inputs. The max number of inputs is {config.embedding_max_inputs}.")
    native = EMBEDDING_MODELS.get(model) or (768 if config.served_model else 0)
    if not native:
        raise Refused(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            "invalid_request_error",
            "model_not_found",
        )
    dims = body.get("dimensions")
    if dims is None:
        dims = native
    elif not model.startswith(SHORTENABLE):
        raise _bad("This model does not support specifying dimensions.")
    elif type(dims) is not int or not 1 <= dims <= native:
        raise _bad(
            f"Invalid value for 'dimensions' = {dims!r}. Must be from 1 to {native}.",
            "invalid_value",
        )
    fmt = body.get("encoding_format", "float")
    if fmt not in ENCODINGS:
        raise _bad(
            f"Invalid value for 'encoding_format': {fmt!r}; expected float or base64.",
            "invalid_value",
        )
    return inputs, model, native, dims, fmt


def input_tokens(config: Any, text: str, model: str) -> int:
    """One input's tokens as the provider counts them (no chat framing): the chat route's
    counting modes and noise, applied to the text."""
    base = chars4_tokens(text) if config.counting == "chars4" else count_text_tokens(text, model)
    return max(1, round(base * noise_factor(text, noise=config.count_noise, seed=config.seed)))


def counted(config: Any, inputs: list[str], model: str) -> int:
    """The request's tokens, or Refused for an input or a sum over the limits."""
    if config.fail_marker and any(config.fail_marker in t for t in inputs):
        raise _bad("The input was rejected (simulator fail_marker).")
    tokens = [input_tokens(config, t, model) for t in inputs]
    limit = config.embedding_max_input_tokens
    if max(tokens) > limit:
        raise _bad(f"Invalid 'input': maximum context length is {limit} tokens.")
    total = sum(tokens)
    if total > config.embedding_max_request_tokens:
        raise Refused(
            400,
            f"Requested {total} tokens, max {config.embedding_max_request_tokens} tokens per request",
            "max_tokens_per_request",
            "max_tokens_per_request",
        )
    return total


# -- the answer ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _word_vector(model: str, word: str, native: int) -> np.ndarray:
    digest = hashlib.sha256(f"{model}\0{word}".encode("utf-8", "surrogatepass")).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little")).standard_normal(
        native, dtype=np.float32
    )


def vector(text: str, model: str, native: int, dims: int) -> np.ndarray:
    """The text's unit vector (float32) of `dims` dimensions."""
    words = _WORD.findall(text.lower()) or [text]
    v = np.sum([_word_vector(model, w, native) for w in words], axis=0)[:dims]
    norm = float(np.linalg.norm(v))
    if norm == 0.0:
        v = np.zeros(dims, dtype=np.float32)
        v[0], norm = 1.0, 1.0
    return (v / norm).astype("<f4")


def answer(
    sim: Simulator, inputs: list[str], model: str, native: int, dims: int, fmt: str, total: int
) -> dict[str, Any]:
    """The create-embeddings response body (floats or base64 of little-endian float32)."""
    data = []
    for i, text in enumerate(inputs):
        v = vector(text, model, native, dims)
        emb: Any = base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v
        data.append({"object": "embedding", "index": i, "embedding": emb})
        sim.stats.prompts[hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()] += 1
    sim.counts["embedding_inputs"] += len(inputs)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }


def _json(
    body: dict[str, Any], status: int = 200, hdrs: dict[str, str] | None = None
) -> web.Response:
    data = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return web.Response(body=data, status=status, content_type="application/json", headers=hdrs)


async def embeddings(sim: Simulator, request: web.Request) -> web.StreamResponse:
    sim.stats.received()
    denied = sim.auth_error(request)
    if denied is not None:
        sim.counts["unauthorized"] += 1
        return denied
    cfg = sim.config
    try:
        try:
            body = await request.json()  # json.loads: takes a lone surrogate escape too
        except ValueError:
            body = None
        model = request.match_info.get("deployment") or (body or {}).get("model")
        inputs, model, native, dims, fmt = parse(cfg, body, model)
        if cfg.insufficient_quota:
            sim.counts["insufficient_quota"] += 1
            raise Refused(
                429,
                "You exceeded your current quota, please check your plan and billing details.",
                "insufficient_quota",
                "insufficient_quota",
            )
        total = counted(cfg, inputs, model)
    except Refused as no:
        sim.counts[f"embedding_refused_{no.status}"] += 1
        return _json(no.body(), no.status)
    limited = admit(sim, model, total)
    if limited is not None:
        return limited
    answer_headers = headers(sim)
    fault = sim.draw_fault()
    if fault:
        sim.counts[f"fault_{fault}"] += 1
        return await sim.fault(request, fault, answer_headers)
    jitter = 1 + cfg.jitter * (2 * sim.rng.random() - 1)
    await sim.slots.serve(lambda: sim.config, 0, jitter)
    sim.counts["embedding_requests"] += 1
    return _json(answer(sim, inputs, model, native, dims, fmt, total), hdrs=answer_headers)


def batch_answer(sim: Simulator, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(status, body) of one /v1/embeddings line of a batch: as the live route answers it, less
    the rate limits (a batch has its own queue)."""
    try:
        inputs, model, native, dims, fmt = parse(sim.config, body, body.get("model"))
        total = counted(sim.config, inputs, model)
    except Refused as no:
        return no.status, no.body()
    payload = answer(sim, inputs, model, native, dims, fmt, total)
    payload["data"] = [
        d | {"embedding": d["embedding"].tolist()} if isinstance(d["embedding"], np.ndarray) else d
        for d in payload["data"]
    ]
    return 200, payload | {"id": f"emb-b{time.time_ns()}"}


def line_tokens(config: Any, body: dict[str, Any]) -> int:
    """A batch line's tokens, for the enqueued-token limit (0 for one the line check refuses)."""
    raw = body.get("input")
    inputs = [raw] if isinstance(raw, str) else raw if isinstance(raw, list) else []
    model = str(body.get("model", ""))
    return sum(input_tokens(config, t, model) for t in inputs if isinstance(t, str) and t)
