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
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine import ChatRequest, ChatResult
from ..engine import errors as E
from ..engine.outcome import ANSWER_CLASSES

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
    }
)
# Engine error classes that say the request itself is wrong: llm-d's INVALID_REQUEST.
_INVALID_CLASSES = frozenset(
    {E.EMPTY_PROMPT, E.CONTEXT_LENGTH, E.BAD_REQUEST, E.UNPROCESSABLE, E.PROMPT_RENDER}
)
# Chat-completion parameters the engine owns or cannot honour in a queue.
_UNSUPPORTED_PARAMS = ("stream", "n")


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
            data.setdefault("internal", {})["retry_count"] = self.retry_count + 1
        else:
            data["retry_count"] = self.retry_count + 1
        return json.dumps(data, separators=(",", ":"))


def _unix(value: Any, name: str, msg_id: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidMessage(f"{name} must be a positive number of Unix seconds", msg_id)
    return float(value)


def parse_message(raw: str | bytes) -> RequestMessage:
    """Validate one queue member; raise InvalidMessage naming the problem."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InvalidMessage(f"message is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidMessage("message must be a JSON object")
    retry_count = data.get("retry_count", 0)
    if isinstance(data.get("data"), dict):  # llm-d's persistence envelope
        internal = data.get("internal") if isinstance(data.get("internal"), dict) else {}
        retry_count = internal.get("retry_count", 0)
        data = data["data"]
    msg_id = data.get("id")
    if not isinstance(msg_id, str | int) or isinstance(msg_id, bool) or str(msg_id) == "":
        raise InvalidMessage("id is missing or not a string")
    msg_id = str(msg_id)
    deadline = _unix(data.get("deadline"), "deadline", msg_id)
    created = data.get("created")
    payload = data.get("payload")
    if not isinstance(payload, dict):
        raise InvalidMessage("payload must be a JSON object (a chat completion body)", msg_id)
    messages = payload.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        hint = " (payload.prompt is for /v1/completions)" if "prompt" in payload else ""
        raise InvalidMessage(
            f"payload.messages must be a list of chat messages: this worker sends chat "
            f"completions{hint}",
            msg_id,
        )
    for key in _UNSUPPORTED_PARAMS:
        if payload.get(key) not in (None, False, 1):
            raise InvalidMessage(f"payload.{key} is not supported by this worker", msg_id)
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
        created=float(created) if isinstance(created, int | float) else None,
        metadata=metadata,
        headers=headers,
        endpoint=endpoint,
        retry_count=retry_count if isinstance(retry_count, int) else 0,
    )


def result_key(msg_id: str, raw: str) -> str:
    """Idempotency key of a result: the id, or a digest of the member when it has none."""
    return msg_id or "sha256:" + hashlib.sha256(raw.encode()).hexdigest()[:32]


def _dump(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


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
