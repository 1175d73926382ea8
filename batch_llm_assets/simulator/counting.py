"""How the simulated provider counts a prompt's tokens, the ways real providers differ.

- `tiktoken`: the model's tokenizer with OpenAI's chat framing (what OpenAI counts).
- `chars4`: a quarter of the characters of the messages' JSON (OpenAI's rule of thumb; what a
  gateway or another provider's tokenizer looks like to a client counting with tiktoken).
- `count_noise`: each prompt's count off by up to +-noise of itself (a tokenizer the client does
  not have). Drawn from the seed and the prompt, so the same prompt counts the same on every
  attempt, and a benchmark can count in-process what the simulator counted.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from ..engine.tokens import count_prompt_tokens

COUNTINGS = ("tiktoken", "chars4")


def chars4_tokens(text: str) -> int:
    """A provider that counts a quarter of the characters (OpenAI's rule of thumb)."""
    return max(1, math.ceil(len(text) / 4))


def messages_digest(messages: Any) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def noise_factor(messages: Any, *, noise: float, seed: int) -> float:
    """1 +- up to `noise`, fixed for this prompt and seed."""
    if not noise:
        return 1.0
    key = f"{seed}:{messages_digest(messages)}".encode()
    x = int(hashlib.sha256(key).hexdigest()[:12], 16) / float(16**12)  # uniform in [0, 1)
    return 1.0 + noise * (2.0 * x - 1.0)


def prompt_tokens(
    messages: Any, model: str, *, counting: str = "tiktoken", noise: float = 0.0, seed: int = 0
) -> int:
    """The prompt's tokens as the provider counts them (its usage and its limits alike)."""
    if counting == "chars4":
        base = chars4_tokens(json.dumps(messages))
    else:
        base = count_prompt_tokens(messages, model)
    return max(1, round(base * noise_factor(messages, noise=noise, seed=seed)))
