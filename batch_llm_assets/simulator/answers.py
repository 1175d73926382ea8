"""Answer shapes a real provider returns besides a plain text answer, for the simulator.

Each shape has its own fraction in SimConfig (`answer_<shape>`). Which prompts get a shape is
decided by the prompt's digest, not a random draw: the same prompt gets the same shape on every
attempt and every rerun, as a model at temperature 0 would, whatever the concurrency.
"""

from __future__ import annotations

import json
import random
import urllib.parse
from typing import Any

SHAPES = ("null_content", "refusal", "content_filter", "length", "tool_calls", "empty_choices")
KEY_ECHOES = ("suffix", "middle", "urlencoded", "json")


def draw_shape(config: Any, digest: str) -> str | None:
    """The shape this prompt gets under the configured fractions, or None for a normal answer."""
    x = int(digest[12:24], 16) / float(16**12)
    for shape in SHAPES:
        p = float(getattr(config, f"answer_{shape}", 0.0) or 0.0)
        if x < p:
            return shape
        x -= p
    return None


def shaped_choice(
    shape: str, content: str, completion_tokens: int, max_tokens: int
) -> tuple[list[dict[str, Any]], int]:
    """(choices, completion tokens billed) of an answer of this shape."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    finish = "stop"
    tokens = completion_tokens
    if shape == "empty_choices":
        return [], tokens
    if shape == "null_content":
        message["content"] = None
    elif shape == "refusal":
        message.update(content=None, refusal="I'm sorry, I can't help with that request.")
    elif shape == "content_filter":
        message["content"] = ""
        finish = "content_filter"
    elif shape == "length":
        words = content.split()
        message["content"] = " ".join(words[: max(1, len(words) // 2)])
        finish, tokens = "length", max_tokens
    elif shape == "tool_calls":
        message["content"] = None
        message["tool_calls"] = [
            {
                "id": "call_sim_1",
                "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"q": content[:40]})},
            }
        ]
        finish = "tool_calls"
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    return [choice], tokens


def echo_key(key: str, how: str | None) -> str:
    """The key as a careless provider echoes it in an error message."""
    if how == "suffix":
        return key[-12:]
    if how == "middle":
        third = max(1, len(key) // 4)
        return f"{key[:2]}...{key[third:-third]}...{key[-2:]}"
    if how == "urlencoded":
        return urllib.parse.quote(key, safe="")
    if how == "json":
        return json.dumps({"api_key": key, "org": "org-sim"})
    return f"{key[:3]}{'*' * 4}{key[-2:]}" if len(key) > 6 else "***"


def has_marker(messages: list[dict[str, Any]], marker: str | None) -> bool:
    """Whether a prompt contains the marker that makes the simulator fail it every time."""
    if not marker:
        return False
    return any(marker in str(m.get("content") or "") for m in messages)


def rejection(
    config: Any, messages: list[dict[str, Any]], sent_key: str, rng: random.Random
) -> str | None:
    """The message of a 400 for this request, or None: prompts with `fail_marker` always, and a
    `fail_400_key_echo` fraction of requests quoting the key that was sent."""
    if has_marker(messages, config.fail_marker):
        return "The prompt was rejected (simulator fail_marker)."
    if config.fail_400_key_echo and rng.random() < config.fail_400_key_echo:
        return f"Invalid token {echo_key(sent_key, config.key_echo or 'suffix')}"
    return None
