"""What the benchmark scripts share: the repo on sys.path, offline tiktoken files, prompts."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
_TIKTOKEN = Path(__file__).resolve().parents[2] / "shared" / "tiktoken"
if _TIKTOKEN.is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(_TIKTOKEN))

WORDS = [
    "markets",
    "rally",
    "as",
    "inflation",
    "cools",
    "bank",
    "shares",
    "slide",
    "oil",
    "climbs",
    "on",
    "supply",
    "fears",
]


def make_prompts(n: int, seed: int = 7) -> list[str]:
    """N headline-like prompts of 5 to 300 words, the same on every run."""
    rng = random.Random(seed)
    return [
        f"Headline {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 300)))
        for i in range(n)
    ]


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]
