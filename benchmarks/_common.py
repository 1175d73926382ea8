"""What the benchmark scripts share: the repo on sys.path, offline tiktoken files, prompts,
busy processes beside a run."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from collections.abc import Iterator
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


@contextlib.contextmanager
def cpu_hogs(k: int) -> Iterator[list[subprocess.Popen]]:
    """K busy processes competing for the cores while the block runs (a shared worker, a
    CPU-throttled pod); each is ended by its own pid at the end."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(k)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            try:
                hog.wait(timeout=10)
            except subprocess.TimeoutExpired:
                hog.kill()
                hog.wait(timeout=10)
