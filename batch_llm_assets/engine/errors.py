"""Error classes of the engine, and the one place that maps HTTP statuses to them."""

from __future__ import annotations

import functools
import json
import re
import urllib.parse
from typing import Any

# Error codes written to result records (`error_class`), one per failure kind.
EMPTY_PROMPT = "empty_prompt"
PROMPT_RENDER = "prompt_render"
CONTEXT_LENGTH = "context_length"
DEADLINE_EXCEEDED = "deadline_exceeded"
RATE_LIMITED = "rate_limited"
SERVER_ERROR = "server_error"
TIMEOUT = "timeout"
CONNECTION_ERROR = "connection_error"
MALFORMED_RESPONSE = "malformed_response"
BAD_REQUEST = "bad_request"
AUTHENTICATION = "authentication"
PERMISSION_DENIED = "permission_denied"
NOT_FOUND = "not_found"
CONFLICT = "conflict"
UNPROCESSABLE = "unprocessable"
LIMITER_UNAVAILABLE = "limiter_unavailable"
LIMITER_ERROR = "limiter_error"
ABORTED = "aborted"
# Typed outputs (assets/structured.py, engine/structured.py).
INVALID_OUTPUT = "invalid_output"  # not JSON, off the schema, or truncated, after repairs
REFUSAL = "refusal"  # the model declined (message.refusal)
STRUCTURED_UNSUPPORTED = "structured_output_unsupported"  # the provider refused the JSON form
INSUFFICIENT_QUOTA = "insufficient_quota"
REQUEST_TOO_LARGE = "request_too_large"
RETRY_BUDGET = "retry_budget_exhausted"
# Flex processing short of capacity: OpenAI's "429 Resource Unavailable" (engine/flex.py).
FLEX_UNAVAILABLE = "resource_unavailable"

_STATUS_CLASSES = {
    400: BAD_REQUEST,
    401: AUTHENTICATION,
    403: PERMISSION_DENIED,
    404: NOT_FOUND,
    408: TIMEOUT,
    409: CONFLICT,
    422: UNPROCESSABLE,
    429: RATE_LIMITED,
}
# Errors that say every further request will fail the same way: they trip the batch's breaker.
FATAL_CLASSES = frozenset({AUTHENTICATION, PERMISSION_DENIED, NOT_FOUND, INSUFFICIENT_QUOTA})
# Fatal at the first occurrence: the key is out of credit, nothing further can succeed.
IMMEDIATELY_FATAL = frozenset({INSUFFICIENT_QUOTA})
# Errors that say nothing about the shared rate: they never slow the limiter down.
NOT_RATE_SIGNALS = frozenset({INSUFFICIENT_QUOTA, REQUEST_TOO_LARGE, FLEX_UNAVAILABLE})
_BILLING_CODES = frozenset(
    {"insufficient_quota", "billing_hard_limit_reached", "billing_not_active", "quota_exceeded"}
)
_TOO_LARGE_CODES = frozenset({"request_too_large", "tokens_exceeded"})


class BatchLLMError(Exception):
    """Base class of this library's errors. Plain Python (the engine imports no Dagster): the
    asset turns it into a `dagster.Failure` carrying the same description and metadata."""

    def __init__(self, description: str = "", metadata: dict[str, Any] | None = None) -> None:
        super().__init__(description)
        self.description = description
        self.metadata = dict(metadata or {})


class LimiterError(BatchLLMError):
    """The limiter's Redis failed a call; the subclass says how (redis_client.error_kind)."""

    error_class = "limiter_error"


class LimiterUnavailableError(LimiterError):
    """The Redis server behind the limiter could not be reached in time (down, failing over,
    loading its data), or stayed so for longer than the outage budget."""

    error_class = "limiter_unavailable"


class LimiterAuthError(LimiterError):
    """The limiter's Redis refused the credentials or the permissions (WRONGPASS, NOPERM)."""


class LimiterScriptError(LimiterError):
    """The limiter's Lua script failed on the server: a bug of ours, never retried."""


class LimiterRefusedError(LimiterError):
    """The limiter's Redis refused a command for a reason no retry fixes (OOM, a wrong type)."""


class ProviderError(Exception):
    """A failed attempt: HTTP status (None for transport faults), error class, retry hint."""

    def __init__(
        self,
        error_class: str,
        message: str,
        *,
        status: int | None = None,
        retryable: bool = False,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
        param: str | None = None,
        hint_exact: bool = True,
    ) -> None:
        super().__init__(message)
        self.error_class = error_class
        self.message = message
        self.status = status
        self.retryable = retryable
        self.retry_after_s = retry_after_s
        self.headers = headers or {}
        self.code = code  # the provider's error code or type, e.g. "insufficient_quota"
        self.param = param  # the parameter the provider named, e.g. "max_tokens"
        self.hint_exact = hint_exact  # False: retry_after_s is whole seconds rounded up

    @property
    def signature(self) -> str:
        """What stays the same when one cause fails many rows: status, code, message shape."""
        return f"{self.status}|{self.code or ''}|{_IDS.sub('#', self.message)[:200]}"

    @property
    def unsupported_param(self) -> str | None:
        """The parameter a 400 says the model does not support (gpt-5 / o-series max_tokens)."""
        if self.status != 400 or self.code not in ("unsupported_parameter", "unsupported_value"):
            return None
        return self.param or next((p for p in _TOKEN_PARAMS if p in self.message), None)


_TOKEN_PARAMS = ("max_tokens", "max_completion_tokens")
# Ids, hex digests and numbers vary between rows failing for one cause: strip them.
_IDS = re.compile(r"(req|chatcmpl|call|run|id)[-_][A-Za-z0-9]+|[0-9a-f]{8,}|\d+(\.\d+)?")


def classify_status(
    status: int, code: str | None, headers: dict[str, str], message: str = ""
) -> tuple[str, bool]:
    """(error class, retryable) for an HTTP error. An explicit x-should-retry header wins,
    except for errors that no retry can fix (out of credit, too large, over the context)."""
    if code == "context_length_exceeded":
        return CONTEXT_LENGTH, False
    if code in _BILLING_CODES:
        return INSUFFICIENT_QUOTA, False
    lowered = message.lower()
    if status == 413 or code in _TOO_LARGE_CODES or "request too large" in lowered:
        return REQUEST_TOO_LARGE, False
    if status == 429 and ("exceeded your current quota" in lowered or "billing" in lowered):
        return INSUFFICIENT_QUOTA, False
    if status == 429 and (code == FLEX_UNAVAILABLE or "resource unavailable" in lowered):
        # Flex short of capacity: not a rate limit, and worth retrying (engine/flex.py).
        return FLEX_UNAVAILABLE, True
    error_class = _STATUS_CLASSES.get(status) or (SERVER_ERROR if status >= 500 else BAD_REQUEST)
    hint = headers.get("x-should-retry")
    if hint in ("true", "false"):
        return error_class, hint == "true"
    return error_class, status in (408, 409, 429) or status >= 500


_KEY_LIKE = re.compile(r"\b(sk|key|api[-_]?key)[-_][A-Za-z0-9_\-*.]{6,}", re.IGNORECASE)
_BEARER = re.compile(r"(Bearer\s+)\S+", re.IGNORECASE)
# A run of this many characters of a key is redacted wherever it appears: providers echo keys
# without their prefix, masked in the middle, URL-encoded or JSON-escaped.
MIN_KEY_FRAGMENT = 8


@functools.lru_cache(maxsize=32)
def _fragments(secret: str) -> frozenset[str]:
    """Every MIN_KEY_FRAGMENT-long piece of the key as sent, URL-encoded or JSON-escaped."""
    forms = {
        secret,
        urllib.parse.quote(secret, safe=""),
        urllib.parse.quote_plus(secret),
        json.dumps(secret)[1:-1],
    }
    n = MIN_KEY_FRAGMENT
    return frozenset(f[i : i + n] for f in forms for i in range(len(f) - n + 1))


def _redact_fragments(text: str, secret: str) -> str:
    pieces = _fragments(secret)
    n = MIN_KEY_FRAGMENT
    covered = [False] * len(text)
    found = False
    for i in range(len(text) - n + 1):
        if text[i : i + n] in pieces:
            covered[i : i + n] = [True] * n
            found = True
    if not found:
        return text
    out: list[str] = []
    for i, ch in enumerate(text):
        if not covered[i]:
            out.append(ch)
        elif i == 0 or not covered[i - 1]:
            out.append("***")
    return "".join(out)


def redact(text: str, *secrets: str | None) -> str:
    """Remove secrets, any run of 8+ characters of one, key-like tokens and bearer credentials
    from text bound for logs, metadata, journals or tables."""
    for secret in secrets:
        if not secret:
            continue
        if len(secret) >= MIN_KEY_FRAGMENT:
            text = _redact_fragments(text, secret)
        elif len(secret) >= 4:
            text = text.replace(secret, "***")
    text = _BEARER.sub(r"\1***", text)
    return _KEY_LIKE.sub(lambda m: m.group(1) + "-***", text)
