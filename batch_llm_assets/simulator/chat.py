"""The chat route: POST /v1/chat/completions (and Azure's deployment form).

In order: the key, the body, the provider's refusals (bad parameters, quota, unknown model, a
flex capacity shortage: tiers.py, context length), then the limits: the request is admitted when both the request and the token
limit admit it now (tokens: the prompt as the provider counts it plus max_tokens, as OpenAI and
Azure OpenAI count at admission), else a 429 with OpenAI's body and headers. An admitted request
is answered after its latency (queued for a decode slot first: slots.py), or gets the fault
drawn for it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from . import kinds, structured, tiers
from .answers import draw_shape, rejection, shaped_choice
from .content import answer, fit, structured_answer
from .counting import messages_digest, prompt_tokens
from .responses import error, limit_headers, openai_duration, retry_headers

if TYPE_CHECKING:
    from .server import Simulator


def _bad_request(message: str, code: str | None = None, param: Any = None) -> web.Response:
    return error(400, message, "invalid_request_error", code, param=param)


async def parse(request: web.Request) -> tuple[dict, list, str, int] | web.Response:
    """(body, messages, model, max_tokens), or a 400 naming what is wrong."""
    try:
        body = await request.json()
        messages = body["messages"]
        model = request.match_info.get("deployment") or body["model"]
    except (ValueError, KeyError, TypeError):
        return _bad_request("request body must be JSON with model and messages")
    if not isinstance(messages, list) or not isinstance(model, str):
        return _bad_request("messages must be a list and model a string")
    budget = body.get("max_completion_tokens") or body.get("max_tokens")
    if budget is not None and not (isinstance(budget, int) and not isinstance(budget, bool)):
        return _bad_request(f"Invalid 'max_tokens': {budget!r}; expected an integer.")
    temperature = body.get("temperature")
    if temperature is not None and not (
        isinstance(temperature, int | float) and 0 <= temperature <= 2
    ):
        return _bad_request(
            f"Invalid 'temperature': {temperature!r}; expected a number from 0 to 2.",
            "invalid_value",
        )
    return body, messages, model, budget


def refused(sim: Simulator, request: web.Request, body: dict, model: str) -> web.Response | None:
    """What the provider refuses before counting anything against the limits."""
    cfg, counts = sim.config, sim.counts
    if cfg.reject_json_schema and structured.rejects(body):  # like an older llama.cpp server
        counts["rejected_json_schema"] += 1
        return error(500, structured.REJECTION_MESSAGE, "server_error", None)
    if cfg.reasoning and "max_tokens" in body:
        counts["unsupported_parameter"] += 1
        return _bad_request(
            "Unsupported parameter: 'max_tokens' is not supported with this model. Use "
            "'max_completion_tokens' instead.",
            "unsupported_parameter",
            param="max_tokens",
        )
    if cfg.insufficient_quota:
        counts["insufficient_quota"] += 1
        return error(
            429,
            "You exceeded your current quota, please check your plan and billing details.",
            "insufficient_quota",
            "insufficient_quota",
        )
    if cfg.fail_param and cfg.fail_param in body:
        counts["fail_param"] += 1
        return error(500, f"Unsupported '{cfg.fail_param}'", "server_error", None)
    if model not in cfg.models and not cfg.served_model:  # one served model answers any name
        counts["not_found"] += 1
        return error(
            404,
            f"The model `{model}` does not exist or you do not have access to it.",
            "invalid_request_error",
            "model_not_found",
        )
    got = request.headers.get("api-key") or request.headers.get("Authorization", "")
    message = rejection(cfg, body["messages"], got.removeprefix("Bearer ").strip(), sim.rng)
    if message is not None:  # the fail marker, or a 400 quoting the key (answers.rejection)
        counts["rejected_400"] += 1
        return _bad_request(message)
    return None


def headers(sim: Simulator) -> dict[str, str]:
    cfg = sim.config
    return limit_headers(
        sim.limits,
        limit_header=cfg.limit_header,
        rate_headers=cfg.rate_headers,
        now=time.monotonic(),
    )


def _rate_limited(sim: Simulator, model: str, cost: int, waits: dict[str, float]):
    sim.stats.rate_limited()
    wait = max(waits.values())
    which = "tokens" if waits.get("tokens") else "requests"
    return error(
        429,
        f"Rate limit reached for {model} on {which} per min. Please try "
        f"again in {openai_duration(wait)}.",
        which,
        "rate_limit_exceeded",
        headers(sim) | retry_headers(sim.config.retry_after, wait),
    )


def injected_429(sim: Simulator, model: str) -> web.Response:
    """A deterministic 429 (fail_429_every), as if another client had emptied the bucket."""
    wait = sim.config.fail_429_retry_after_s
    sim.stats.rate_limited()
    sim.counts["fault_429"] += 1
    extra = {
        "retry-after-ms": str(max(1, round(wait * 1000))),
        "retry-after": str(max(1, round(wait))),
    }
    return error(
        429,
        f"Rate limit reached for {model} on requests per min. Please try again in "
        f"{openai_duration(wait)}.",
        "requests",
        "rate_limit_exceeded",
        headers(sim) | extra,
    )


def admit(sim: Simulator, model: str, cost: int) -> web.Response | None:
    """Take the request's cost from the limits, or the 429 it gets instead."""
    cfg = sim.config
    if cfg.tpm and cost > cfg.tpm:
        sim.counts["too_large"] += 1
        return error(
            429,
            f"Request too large for {model} on tokens per min (TPM): Limit {cfg.tpm}, "
            f"Requested {cost}.",
            "tokens",
            "rate_limit_exceeded",
        )
    now = time.monotonic()
    costs = {"requests": 1, "tokens": cost}
    waits = {
        name: limit.wait_for(costs[name], now)
        for name, limit in sim.limits.items()
        if limit is not None
    }
    if any(waits.values()):
        return _rate_limited(sim, model, cost, waits)
    if cfg.fail_429_every > 0:
        sim.counts["seen_for_429"] += 1
        if sim.counts["seen_for_429"] % cfg.fail_429_every == 0:
            return injected_429(sim, model)
    for name, limit in sim.limits.items():
        if limit is not None:
            limit.take(costs[name], now)
    sim.stats.admitted(cost)
    return None


async def chat(sim: Simulator, request: web.Request) -> web.StreamResponse:
    sim.stats.received()
    sim.stats.saw_headers(request.headers)
    denied = sim.auth_error(request)
    if denied is not None:
        sim.counts["unauthorized"] += 1
        return denied
    parsed = await parse(request)
    if isinstance(parsed, web.Response):
        return parsed
    body, messages, model, budget = parsed
    sim.stats.heard(messages)
    cfg = sim.config
    no = refused(sim, request, body, model) or tiers.refusal(
        sim, body, model, messages_digest(messages)
    )
    if no is not None:
        return no
    prompt = prompt_tokens(
        messages, model, counting=cfg.counting, noise=cfg.count_noise, seed=cfg.seed
    )
    max_tokens = budget or cfg.default_max_tokens
    window = cfg.models[cfg.served_model or model]
    if prompt + max_tokens > window:
        sim.counts["context_length"] += 1
        return _bad_request(
            f"This model's maximum context length is {window} tokens. However, "
            f"you requested {prompt + max_tokens} tokens.",
            "context_length_exceeded",
        )
    limited = admit(sim, model, prompt + max_tokens)
    if limited is not None:
        return limited
    answer_headers = headers(sim)
    fault = sim.draw_fault()
    if fault:
        sim.counts[f"fault_{fault}"] += 1
        return await sim.fault(request, fault, answer_headers)
    return await _answer(sim, body, messages, model, max_tokens, prompt, answer_headers)


async def _answer(sim, body, messages, model, max_tokens, prompt, answer_headers):
    cfg = sim.config
    refusal = None
    schema = structured.requested_schema(body)
    form = kinds.form_of(body)
    if form is not None:
        sim.counts[f"form_{form}"] += 1
    if schema and not kinds.honours(cfg.server_kind, form):
        sim.counts["form_ignored"] += 1  # this kind of server does not read that form
        content, completion, finish = fit(kinds.schema_copied_back(schema), model, max_tokens)
    elif schema is not None:  # typed outputs: JSON generated from the schema
        content, refusal, completion, finish = structured_answer(
            schema, messages, model, max_tokens, config=cfg
        )
    else:
        content, completion, finish = answer(
            messages, model, max_tokens, max_answer_tokens=cfg.max_answer_tokens
        )
    if cfg.surrogate_every > 0:
        sim.counts["seen_for_surrogate"] += 1
        if sim.counts["seen_for_surrogate"] % cfg.surrogate_every == 0:
            content += "\ud83d"  # valid JSON ("\\ud83d"), not valid Unicode text
            sim.counts["fault_surrogate"] += 1
    message = {"role": "assistant", "content": content, "refusal": refusal}
    choices = [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}]
    digest = messages_digest(messages)
    shape = draw_shape(cfg, digest)
    if shape is not None:
        sim.counts[f"shape_{shape}"] += 1
        choices, completion = shaped_choice(shape, content, completion, max_tokens)
    jitter = 1 + cfg.jitter * (2 * sim.rng.random() - 1)
    await sim.slots.serve(lambda: sim.config, completion, jitter)  # queue and decode (slots.py)
    sim.counts["answered"] += 1
    sim.counts["completion_tokens"] += completion
    sim.stats.prompts[digest] += 1
    return web.json_response(
        {
            "id": f"chatcmpl-{sim.counts['answered']}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": kinds.answer_model(cfg, model),
            **tiers.served(body),
            "choices": choices,
            **usage(cfg.usage_shape, prompt, completion),
        },
        headers=answer_headers,
    )


def usage(shape: str, prompt: int, completion: int) -> dict[str, Any]:
    if shape == "none":
        return {}
    if shape == "input_output":
        return {"usage": {"input_tokens": prompt, "output_tokens": completion}}
    total = prompt + completion
    return {
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}
    }
