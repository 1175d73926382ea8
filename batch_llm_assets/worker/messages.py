"""llm-d's async-processor message formats: request messages in, result messages out.

A request is `{"id", "created", "deadline", "payload", "metadata", "headers", "endpoint"}`
(times in Unix seconds), either bare or in llm-d's persistence envelope
`{"internal": {...}, "request_kind": ..., "data": {<request>}}`. A result is
`{"id", "status_code", "payload"}` when an HTTP answer was received, else
`{"id", "error_code", "error_message", "payload"}`, as llm-d's `api.ResultMessage`.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine import ChatRequest, ChatResult
from ..engine import errors as E
from ..engine.outcome import ANSWER_CLASSES
from . import _constants as K

# llm-d's result error codes (api.ErrCode*).
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
CANCELLED = "CANCELLED"
INFERENCE_ERROR = "INFERENCE_ERROR"
INVALID_REQUEST = "INVALID_REQUEST"

# Engine error classes that a later attempt may cure: the message goes to the retry set.
RETRYABLE_CLASSES = frozenset(
    {
        E.RATE_LIMITED,
        E.SERVER_ERROR,
        E.TIMEOUT,
        E.CONNECTION_ERROR,
        E.MALFORMED_RESPONSE,
        E.CONFLICT,
        E.LIMITER_UNAVAILABLE,
        E.FLEX_UNAVAILABLE,
    }
)
# Engine error classes that say the request itself is wrong: llm-d's INVALID_REQUEST.
_INVALID_CLASSES = frozenset(
    {E.EMPTY_PROMPT, E.CONTEXT_LENGTH, E.BAD_REQUEST, E.UNPROCESSABLE, E.PROMPT_RENDER}
)
# Chat-completion parameters of one JSON type: a wrong one is refused before anything is paid.
_TYPED_PARAMS: dict[str, type | tuple[type, ...]] = {
    "max_tokens": int,
    "max_completion_tokens": int,
    "seed": int,
    "top_logprobs": int,
    "temperature": (int, float),
    "top_p": (int, float),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
}


class InvalidMessage(ValueError):
    """A message that cannot be dispatched; `id` is what could be read of it ("" if nothing)."""

    def __init__(self, message: str, msg_id: str = "") -> None:
        super().__init__(message)
        self.id = msg_id


@dataclass(slots=True)
class RequestMessage:
    """One parsed request. `raw` is the queue member exactly as read (its identity in Redis)."""

    id: str
    deadline: float
    payload: dict[str, Any]
    raw: str
    created: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    endpoint: str = ""
    retry_count: int = 0

    @property
    def producer(self) -> str:
        """Who sent it, for the breaker's scope: metadata.producer ("" when not named)."""
        producer = self.metadata.get("producer")
        return producer if isinstance(producer, str) else ""

    def to_chat_request(self, model: str) -> ChatRequest:
        """The engine's request: `messages`, and every other payload key as a parameter."""
        requested = self.payload.get("model")
        if requested not in (None, "", model):
            raise InvalidMessage(
                f"payload model {requested!r} is not the model this worker serves ({model!r})",
                self.id,
            )
        params = {k: v for k, v in self.payload.items() if k not in ("model", "messages")}
        deadline = time.monotonic() + (self.deadline - time.time())
        return ChatRequest(
            id=self.id, messages=self.payload["messages"], params=params, deadline=deadline
        )

    def with_retry(self) -> str:
        """The member to re-enqueue: the same request, its retry count one higher."""
        data = json.loads(self.raw)
        if isinstance(data.get("data"), dict):
            if not isinstance(data.get("internal"), dict):
                data["internal"] = {}
            data["internal"]["retry_count"] = self.retry_count + 1
        else:
            data["retry_count"] = self.retry_count + 1
        return json.dumps(data, separators=(",", ":"))


def _deadline(value: Any, msg_id: str) -> float:
    """Unix seconds, finite, not before 2001 and not more than a year ahead (milliseconds)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidMessage("deadline must be a number of Unix seconds", msg_id)
    if not math.isfinite(value):
        raise InvalidMessage(
            f"deadline must be a finite number of Unix seconds, got {value}", msg_id
        )
    if value < K.EARLIEST_DEADLINE_S:
        raise InvalidMessage(
            f"deadline {value} is not Unix seconds (before 2001): an absolute time is needed, "
            "not a number of seconds from now",
            msg_id,
        )
    if value > time.time() + K.MAX_DEADLINE_AHEAD_S:
        raise InvalidMessage(
            f"deadline {value} is more than a year ahead: Unix seconds are needed, not "
            "milliseconds",
            msg_id,
        )
    return float(value)


def _check_messages(messages: Any, payload: dict[str, Any], msg_id: str) -> None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        hint = " (payload.prompt is for /v1/completions)" if "prompt" in payload else ""
        raise InvalidMessage(
            f"payload.messages must be a list of chat messages: this worker sends chat "
            f"completions{hint}",
            msg_id,
        )
    for i, m in enumerate(messages):
        role = m.get("role")
        if role is None:
            raise InvalidMessage(
                f"payload.messages[{i}] has no role (system, user, assistant, ...)", msg_id
            )
        if not isinstance(role, str) or not role:
            raise InvalidMessage(f"payload.messages[{i}].role must be a non-empty string", msg_id)
        if not isinstance(m.get("content"), str | list | None):
            raise InvalidMessage(
                f"payload.messages[{i}].content must be a string, a list of parts or null", msg_id
            )


def _check_params(payload: dict[str, Any], msg_id: str) -> None:
    """The parameters the worker reads or that must be of one type, checked before any send."""
    stream = payload.get("stream")
    if stream is not None and stream is not False:
        raise InvalidMessage(
            f"payload.stream must be false or absent (got {stream!r}): this worker does not "
            "stream answers",
            msg_id,
        )
    n = payload.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise InvalidMessage(f"payload.n must be 1 or absent (got {n!r})", msg_id)
    for key, kind in _TYPED_PARAMS.items():
        value = payload.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kind):
            what = "an integer" if kind is int else "a number"
            raise InvalidMessage(f"payload.{key} must be {what}, got {value!r}", msg_id)
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidMessage(f"payload.{key} must be finite, got {value}", msg_id)
        if key in ("max_tokens", "max_completion_tokens") and value < 1:
            raise InvalidMessage(f"payload.{key} must be at least 1, got {value}", msg_id)


def _envelope(text: str) -> tuple[dict[str, Any], Any]:
    """The request object and its retry count, bare or in llm-d's persistence envelope."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidMessage(f"message is not JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise InvalidMessage("message must be a JSON object")
    retry_count = data.get("retry_count", 0)
    if isinstance(data.get("data"), dict):  # llm-d's persistence envelope
        internal = data.get("internal") if isinstance(data.get("internal"), dict) else {}
        retry_count = internal.get("retry_count", 0)
        data = data["data"]
    return data, retry_count


def parse_message(raw: str | bytes) -> RequestMessage:
    """Validate one queue member; raise InvalidMessage naming the problem."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    data, retry_count = _envelope(text)
    msg_id = data.get("id")
    if not isinstance(msg_id, str | int) or isinstance(msg_id, bool) or str(msg_id) == "":
        raise InvalidMessage("id is missing or not a string")
    msg_id = str(msg_id)
    deadline = _deadline(data.get("deadline"), msg_id)
    created = data.get("created")
    if created is not None and (
        isinstance(created, bool)
        or not isinstance(created, int | float)
        or not math.isfinite(created)
    ):
        raise InvalidMessage(f"created must be Unix seconds, got {created!r}", msg_id)
    payload = data.get("payload")
    if not isinstance(payload, dict):
        raise InvalidMessage("payload must be a JSON object (a chat completion body)", msg_id)
    _check_messages(payload.get("messages"), payload, msg_id)
    _check_params(payload, msg_id)
    endpoint = data.get("endpoint") or ""
    if not isinstance(endpoint, str) or (
        endpoint and not endpoint.rstrip("/").endswith("chat/completions")
    ):
        raise InvalidMessage(
            f"endpoint {endpoint!r} is not supported: this worker sends chat completions", msg_id
        )
    metadata = data.get("metadata") or {}
    headers = data.get("headers") or {}
    if not isinstance(metadata, dict) or not isinstance(headers, dict):
        raise InvalidMessage("metadata and headers must be JSON objects of strings", msg_id)
    return RequestMessage(
        id=msg_id,
        deadline=deadline,
        payload=payload,
        raw=text,
        created=float(created) if created is not None else None,
        metadata=metadata,
        headers=headers,
        endpoint=endpoint,
        retry_count=retry_count if type(retry_count) is int and retry_count >= 0 else 0,
    )


def created_of(raw: str | bytes) -> float | None:
    """A member's `created` (Unix seconds), when it has a usable one."""
    try:
        data, _ = _envelope(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw)
    except InvalidMessage:
        return None
    created = data.get("created")
    if isinstance(created, bool) or not isinstance(created, int | float):
        return None
    return float(created) if math.isfinite(created) else None


def id_key(msg_id: str) -> str:
    """The id as it goes into Redis key names: a digest when it is long or not text Redis
    takes (a lone surrogate from a JSON escape)."""
    if len(msg_id) <= K.MAX_ID_IN_KEY and storable(msg_id) is msg_id:
        return msg_id
    return "sha256:" + hashlib.sha256(msg_id.encode("utf-8", "surrogatepass")).hexdigest()


def result_key(msg_id: str, raw: str | bytes) -> str:
    """Idempotency key of a result: the id, or a digest of the member when it has none."""
    if msg_id:
        return id_key(msg_id)
    data = raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogatepass")
    return "sha256:" + hashlib.sha256(data).hexdigest()[:32]


def storable(text: str) -> str:
    """Text Redis takes: a lone UTF-16 surrogate (an answer can carry one) becomes U+FFFD, as the
    asset pipeline's writer does; a valid pair becomes its character."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _dump(obj: dict[str, Any]) -> str:
    return storable(json.dumps(obj, separators=(",", ":"), ensure_ascii=False))


def error_result(msg_id: str, code: str, message: str) -> str:
    """llm-d's non-HTTP result: error_code, error_message and {"error": ...} as payload."""
    return _dump(
        {
            "id": msg_id,
            "payload": _dump({"error": message}),
            "error_code": code,
            "error_message": message,
        }
    )


def answered(result: ChatResult) -> bool:
    """The provider answered (HTTP 200): an ok answer, or one a batch row would fail for its
    shape (truncated, refusal, content_filter, ...). A queue caller gets those as llm-d does,
    a 200 whose payload carries finish_reason and refusal, and judges them itself."""
    return result.ok or result.error_class in ANSWER_CLASSES


def ok_result(msg: RequestMessage, result: ChatResult, model: str) -> str:
    """An HTTP 200 result whose payload is a chat.completion body rebuilt from the answer."""
    body = {
        "id": f"chatcmpl-{msg.id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": result.response,
                    **({"refusal": result.refusal} if result.refusal else {}),
                },
                "finish_reason": result.finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": (result.prompt_tokens or 0) + (result.completion_tokens or 0),
        },
    }
    return _dump({"id": msg.id, "status_code": 200, "payload": _dump(body)})


def failed_code(result: ChatResult) -> str:
    """llm-d's error code for a final engine failure."""
    if result.error_class == E.DEADLINE_EXCEEDED:
        return DEADLINE_EXCEEDED
    if result.error_class in _INVALID_CLASSES:
        return INVALID_REQUEST
    return INFERENCE_ERROR


def dead_letter_entry(
    *,
    msg_id: str,
    member: bytes,
    cause: str,
    deliveries: int,
    queue: str,
    result: str,
    answer: str | None,
) -> str:
    """What the dead-letter list keeps of a message: the member as read, why it is there, the
    error result sent for it, and the answer already paid for, if there was one."""
    return _dump(
        {
            "id": msg_id,
            "queue": queue,
            "cause": cause,
            "deliveries": deliveries,
            "dead_lettered_at": round(time.time(), 3),
            "result": result,
            "answer": answer,
            "message": member.decode("utf-8", "replace"),
        }
    )
