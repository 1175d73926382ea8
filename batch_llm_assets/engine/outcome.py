"""What an HTTP 200 answer is worth: a row is `ok` only for a complete answer.

A pure function of the parsed response, so every provider shape is decided in one place and the
same way on every transport. A 200 is not a success when the text was cut at max_tokens, was
filtered, was refused, is missing, or is a tool call nobody asked for: stored as `ok`, such a row
would be skipped by every rerun although its label cannot be trusted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .errors import MALFORMED_RESPONSE
from .transport import ChatResponse

# Error classes of answers that arrived (HTTP 200) but are not a usable answer.
TRUNCATED = "truncated"
CONTENT_FILTER = "content_filter"
REFUSAL = "refusal"
UNEXPECTED_TOOL_CALL = "unexpected_tool_call"
EMPTY_ANSWER = "empty_answer"
EMPTY_CHOICES = "empty_choices"  # detail of malformed_response, in the message

ANSWER_CLASSES = (TRUNCATED, CONTENT_FILTER, REFUSAL, UNEXPECTED_TOOL_CALL, EMPTY_ANSWER)


@dataclass(frozen=True, slots=True)
class Outcome:
    """The verdict on one answer. `retry` asks for one more attempt (empty `choices` only)."""

    status: str  # "ok" or "failed"
    response: str | None
    error_class: str | None = None
    message: str | None = None
    retry: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def tools_requested(body: dict[str, Any]) -> bool:
    """Whether the request offered tools (or legacy functions) the model may call."""
    return bool(body.get("tools") or body.get("functions"))


def classify_answer(resp: ChatResponse, *, tools_allowed: bool, max_tokens: int) -> Outcome:
    """ok only for a complete answer; otherwise failed with the reason a reader can act on."""
    if resp.empty_choices:
        return Outcome(
            "failed",
            None,
            MALFORMED_RESPONSE,
            f"{EMPTY_CHOICES}: the provider answered HTTP 200 with an empty `choices` list",
            retry=True,
        )
    finish = resp.finish_reason
    if resp.refusal:
        return Outcome(
            "failed", None, REFUSAL, f"the model refused to answer: {str(resp.refusal)[:300]}"
        )
    if finish == "content_filter":
        return Outcome(
            "failed",
            resp.content,
            CONTENT_FILTER,
            "the provider's content filter withheld the answer (finish_reason=content_filter)",
        )
    if resp.tool_calls:
        if not tools_allowed:
            return Outcome(
                "failed",
                resp.content,
                UNEXPECTED_TOOL_CALL,
                f"the model called a tool ({len(resp.tool_calls)} call(s)) but the request "
                "offered none",
            )
        if not resp.content:  # the calls are the answer
            return Outcome("ok", json.dumps(resp.tool_calls, sort_keys=True))
    if finish == "length":
        return Outcome(
            "failed",
            resp.content,
            TRUNCATED,
            f"the answer was cut at the answer budget ({max_tokens} tokens, "
            "finish_reason=length): raise max_tokens (or max_completion_tokens) and rerun",
        )
    if resp.content is None:
        return Outcome(
            "failed",
            None,
            REFUSAL,
            "the answer has no content and no tool call (a refusal or an empty message)",
        )
    if not resp.content.strip():
        return Outcome("failed", resp.content, EMPTY_ANSWER, "the answer is empty")
    return Outcome("ok", resp.content)
