"""Structured output on the wire: how each provider is asked for JSON, and the repair loop.

`shape_request` is pure: (provider kind, JSON Schema, messages, params) -> (params, messages).
The forms, by provider:
- openai, azure, gemini (OpenAI-compatible endpoint), ollama: `response_format` json_schema,
  strict when the schema allows it;
- vllm: guided decoding, `structured_outputs: {"json": schema}` (vLLM >= 0.10; the older
  `guided_json` is deprecated there);
- llamacpp: `response_format: {"type": "json_object", "schema": ...}` (its server answers
  json_schema with HTTP 500 in older builds);
- generic: `json_object` plus the schema in the system prompt.
Every other form constrains decoding without showing the schema to the model, so the schema's
descriptions, enums and bounds are also stated in the system prompt (constraints.schema_note).
The validation hook (`ChatRequest.validate`) and `repair` live here too, so `Engine.run_one`
only calls them.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _constants as C
from . import errors as E
from .constraints import Violation, clean, schema_note, unparsable
from .profiles import detect_provider

if TYPE_CHECKING:
    from .breaker import Breaker
    from .requests import ChatRequest, ChatResult

KINDS = ("openai", "azure", "gemini", "vllm", "llamacpp", "ollama", "generic")
SCHEMA_MARKER = "Reply with one JSON object, and nothing else, that matches this JSON Schema:"
# A provider's 4xx/5xx that says it does not take this form of structured output.
_REJECTION = re.compile(
    r"response_format|json_schema|guided_json|structured_outputs|structured output|grammar",
    re.IGNORECASE,
)


def provider_kind(
    base_url: str,
    *,
    api_version: str | None = None,
    provider: str | None = None,
    detected: str | None = None,
) -> str:
    """The structured-output form to ask in: an explicit `provider` wins, then a hosted API's
    URL, then what the server said it is (`detected`, server_probe.py: Ollama shares
    llama.cpp's profile but has a form of its own), else generic."""
    hosted = detect_provider(base_url, api_version=api_version)
    name = provider or (hosted if hosted != "generic" else detected) or "generic"
    name = re.sub(r"[^a-z]", "", name.lower())
    name = {"azureopenai": "azure", "llama": "llamacpp", "llamacpppython": "llamacpp"}.get(
        name, name
    )
    return name if name in KINDS else "generic"


def shape_request(
    kind: str,
    schema: dict[str, Any],
    messages: list[dict[str, Any]],
    params: dict[str, Any],
    *,
    name: str = "output",
    strict: bool = True,
    note: str | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The request's params and messages asking `kind` for an answer matching `schema`.

    The inputs are not changed. A `response_format` already in params is replaced: the schema
    decides the answer's shape. Every form but generic's (which states the whole schema) gets
    the schema's constraints in the system prompt, which the model reads and a grammar does not:
    `note` when the caller worked it out once for many rows ("" for none), else schema_note.
    """
    params = {k: v for k, v in params.items() if k != "response_format"}
    if kind in ("openai", "azure", "gemini", "ollama"):
        params["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": _schema_name(name), "schema": schema, "strict": strict},
        }
    elif kind == "vllm":
        params["structured_outputs"] = {"json": schema}
    elif kind == "llamacpp":
        params["response_format"] = {"type": "json_object", "schema": schema}
    elif kind == "generic":
        params["response_format"] = {"type": "json_object"}
        return params, with_schema_prompt(messages, schema)
    else:
        raise ValueError(f"unknown provider kind {kind!r}; expected one of {', '.join(KINDS)}")
    note = schema_note(schema) if note is None else note
    return params, (with_system_note(messages, note) if note else list(messages))


def with_schema_prompt(
    messages: list[dict[str, Any]], schema: dict[str, Any]
) -> list[dict[str, Any]]:
    """The messages with the schema stated at the end of the system message (one is added)."""
    compact = json.dumps(schema, sort_keys=True, separators=(",", ":"))  # fewer prompt tokens
    return with_system_note(messages, f"{SCHEMA_MARKER}\n{compact}")


def with_system_note(messages: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    """The messages with `note` at the end of the system message (one is added); the given
    messages are not changed (each is copied: only a content is replaced)."""
    out = [dict(m) for m in messages]
    for m in out:
        if m.get("role") == "system" and isinstance(m.get("content"), str):
            m["content"] = f"{m['content']}\n\n{note}"
            return out
    return [{"role": "system", "content": note}, *out]


def _schema_name(name: str) -> str:
    """OpenAI's json_schema.name: a-z, A-Z, 0-9, underscores and dashes, at most 64."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64] or "output"


def rejects_structured(exc: E.ProviderError) -> bool:
    """True when the provider refused the structured-output form itself (400/422/500 naming it):
    every row would fail the same way, so it is not retried and it trips the breaker."""
    return exc.status in (400, 422, 500) and bool(_REJECTION.search(exc.message or ""))


def rejection_message(exc: E.ProviderError) -> str:
    return (
        f"the provider rejected the structured-output request ({exc.message}); choose the form "
        "it supports with the LLM resource's provider setting (e.g. llamacpp, vllm, generic)"
    )


# -- validation and repair ------------------------------------------------------------------------
class Problem(NamedTuple):
    """What is wrong with an answer: the row's error class and message, and for an answer that
    broke a rule of the schema, the rule (the breaker compares it across rows)."""

    error_class: str
    message: str
    violation: Violation | None = None


Validate = Callable[["ChatResult"], "tuple[str, str] | Problem | None"]


def validator(parse: Callable[[str | None], Any]) -> Validate:
    """A `ChatRequest.validate` from a parser that raises ValueError on a bad answer (a
    constraints.Violation to say which rule): refusal -> ("refusal", its text); truncated,
    invalid JSON or off-schema -> invalid_output, its message bounded."""

    def check(result: ChatResult) -> Problem | None:
        if result.refusal:
            return Problem(E.REFUSAL, f"the model refused: {result.refusal}")
        try:
            parse(result.response)
        except ValueError as exc:
            said = clean(str(exc), C.REPAIR_PROBLEM_MAX_CHARS)
            if result.finish_reason == "length":
                said = f"answer truncated at max_tokens ({said})"
                return Problem(E.INVALID_OUTPUT, said, unparsable(said, rule="max_tokens"))
            return Problem(E.INVALID_OUTPUT, said, exc if isinstance(exc, Violation) else None)
        if result.finish_reason == "content_filter":
            return Problem(E.INVALID_OUTPUT, "answer cut by the provider's content filter")
        return None

    return check


def repair_messages(
    messages: list[dict[str, Any]], answer: str | None, problem: str
) -> list[dict[str, Any]]:
    """The follow-up: the conversation so far, the bad answer (at most REPAIR_ANSWER_MAX_CHARS
    of it: a runaway answer is not paid for twice), and what was wrong with it."""
    answer = answer or ""
    if len(answer) > C.REPAIR_ANSWER_MAX_CHARS:
        answer = f"{answer[: C.REPAIR_ANSWER_MAX_CHARS]}…"
    return [
        *messages,
        {"role": "assistant", "content": answer},
        {
            "role": "user",
            "content": f"That answer was not valid: {problem}. Reply again with only the "
            "corrected JSON object.",
        },
    ]


async def validated(
    send: Callable[[ChatRequest], Awaitable[ChatResult]],
    req: ChatRequest,
    first: ChatResult,
    breaker: Breaker | None = None,
) -> ChatResult:
    """Validate an ok answer; re-ask up to req.repair_attempts times with the error. Tokens,
    attempts, latency and waits add up over every request made for the row. The row's verdict
    goes to the breaker: rows failing the same rule one after another stop the run."""
    from .requests import ChatRequest

    result, total = first, first
    messages = list(req.messages or [])
    for repair in range(req.repair_attempts + 1):
        problem = req.validate(result) if req.validate is not None else None
        if problem is None:
            if breaker is not None:
                breaker.answer_valid()
            return _merged(total, result, "ok", None, None)
        if problem[0] != E.INVALID_OUTPUT or repair == req.repair_attempts:
            rule = problem.violation if isinstance(problem, Problem) else None
            if breaker is not None and rule is not None and problem[0] == E.INVALID_OUTPUT:
                breaker.answer_invalid(rule)
            return _merged(total, result, "failed", problem[0], problem[1])
        messages = repair_messages(messages, result.response, problem[1])
        follow = ChatRequest(req.id, messages, params=req.params, deadline=req.deadline)
        result = await send(follow)
        total = _add(total, result)
        # The provider failed the follow-up itself: that is the row's error (a truncated answer
        # is validated: it is invalid JSON).
        if not result.ok and result.error_class != "truncated":
            return _merged(total, result, "failed", result.error_class, result.error_message)
    raise AssertionError("unreachable")


def _add(a: ChatResult, b: ChatResult) -> ChatResult:
    """Running totals of two requests for one row (the second one's answer)."""
    return type(a)(
        a.id,
        b.status,
        response=b.response,
        finish_reason=b.finish_reason,
        prompt_tokens=_sum(a.prompt_tokens, b.prompt_tokens),
        completion_tokens=_sum(a.completion_tokens, b.completion_tokens),
        latency_ms=_sum(a.latency_ms, b.latency_ms),
        attempts=a.attempts + b.attempts,
        estimated_tokens=_sum(a.estimated_tokens, b.estimated_tokens),
        rate_limit_wait_s=a.rate_limit_wait_s + b.rate_limit_wait_s,
        http_429=a.http_429 + b.http_429,
        refusal=b.refusal,
    )


def _merged(
    total: ChatResult, last: ChatResult, status: str, error_class: str | None, message: str | None
) -> ChatResult:
    """The row's result: `total`'s sums (which include `last`), `last`'s answer, the verdict."""
    out = copy.copy(total)
    out.status, out.error_class, out.error_message = status, error_class, message
    out.response, out.finish_reason, out.refusal = last.response, last.finish_reason, last.refusal
    return out


def _sum(a: Any, b: Any) -> Any:
    if a is None:
        return b
    return a if b is None else a + b
