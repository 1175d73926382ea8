"""The randomized suite's providers: what is drawn, each job's size, and its ideal.

benchmarks/_randomized.py says what is drawn and why, and defines the figures.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

from _common import make_prompts, messages

from batch_llm_assets.engine._constants import DEFAULT_BURST_S
from batch_llm_assets.simulator.counting import prompt_tokens
from batch_llm_assets.simulator.limits import make_limit

MODEL = "gpt-4o-mini"
MAX_TOKENS = 64
LATENCY = {"latency_ms": 20.0, "latency_per_token_ms": 0.2}  # the simulator's
RPS = (3.0, 150.0)  # binding rate, in requests per second
MAX_BURST = 200  # requests the provider admits at once, at most
TARGET_S = (6.0, 12.0)
# One provider in LONG_EVERY gets a job of LONG_TARGET_S instead: more than a minute's worth of
# its limit, so the configured ceiling (a minute's total) is judged over whole minutes.
LONG_EVERY = 5
LONG_TARGET_S = (65.0, 72.0)
# The perfect client paces at min(configured, true) with the engine's default burst: a client
# that paces at that rate scores 1. Jobs are still sized with the 0.5 s burst the suite was
# written with (the engine's default then), so a seed draws the same jobs as before, and the
# utilisation against that stricter ideal is reported beside (`with_burst`).
PACED_BURST_S = DEFAULT_BURST_S
SIZING_BURST_S = 0.5
MAX_IDEAL_S = 80.0  # a provider whose job would take longer is drawn again
RATIO = (0.7, 1.3)
SLACK = 3.0  # the limit that does not bind, over the one that does
CEILING_S = 60.0  # the configured limit is per minute: at most that much in any 60 s
MAX_PROMPTS = 4000
# At least this many requests per job: below it one 429 is over 1 % of the job, finer than
# the 429 share can be read (the target is <= 1.5 % in any provider).
MIN_REQUESTS = 100
MAX_PROCESSES = 4


@dataclass
class Provider:
    """One drawn provider: its enforcement, headers and counting, the client side (configured
    over true, processes, a CPU hog) and the binding rate. size() sets rpm and tpm, the true
    limits; the configured ones are those x ratio."""

    index: int
    family: str  # bucket | fixed | sliding | quantized | azure
    shape: dict  # the simulator's enforcement settings
    shape_s: float  # seconds of the limit admitted at once
    headers: str  # all | remaining_reset | none
    limit_header: str  # per_minute | capacity | none
    counting: str
    noise: float
    ratio: float
    processes: int
    hog: bool
    bind: str
    rps: float
    target_s: float
    seed: int
    rpm: int = 0
    tpm: int = 0

    @property
    def label(self) -> str:
        shape = "1s+10s" if self.family == "azure" else f"{self.shape_s:.3g}s"
        return f"{self.family} {shape}"

    @property
    def configured(self) -> tuple[int, int]:
        return max(1, int(self.rpm * self.ratio)), max(1, int(self.tpm * self.ratio))

    def cost(self, prompt: str) -> int:
        """The request's tokens as the provider counts them at admission."""
        counted = prompt_tokens(
            messages(prompt), MODEL, counting=self.counting, noise=self.noise, seed=self.seed
        )
        return counted + MAX_TOKENS

    def sim_settings(self) -> dict:
        return {
            "rpm": self.rpm,
            "tpm": self.tpm,
            "counting": self.counting,
            "count_noise": self.noise,
            "seed": self.seed,
            "limit_header": self.limit_header,
            "rate_headers": self.headers != "none",
            **LATENCY,
            **self.shape,
        }


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _enforcement(rng: random.Random) -> tuple[str, dict, float]:
    family = rng.choice(("bucket", "fixed", "sliding", "quantization"))
    if family == "bucket":
        s = _log_uniform(rng, 0.1, 60.0)
        return family, {"enforcement": "bucket", "bucket_s": s}, s
    if family in ("fixed", "sliding"):
        s = _log_uniform(rng, 1.0, 60.0)
        return family, {"enforcement": f"{family}_window", "window_s": s}, s
    period = rng.choice((1.0, 10.0, None))  # None: Azure's 1 s and 10 s at once
    if period is None:
        return "azure", {"enforcement": "azure"}, 1.0
    return "quantized", {"enforcement": "quantized", "quantum_s": period}, period


def draw(rng: random.Random, index: int) -> Provider:
    family, shape, shape_s = _enforcement(rng)
    headers = rng.choice(("all", "remaining_reset", "none"))
    limit_header = rng.choice(("per_minute", "capacity")) if headers == "all" else "none"
    return Provider(
        index=index,
        family=family,
        shape=shape,
        shape_s=shape_s,
        headers=headers,
        limit_header=limit_header,
        counting=rng.choice(("tiktoken", "chars4")),
        noise=rng.choice((0.0, 0.1)),
        ratio=rng.uniform(*RATIO),
        processes=rng.randint(1, MAX_PROCESSES),
        hog=rng.random() < 0.5,
        bind=rng.choice(("rpm", "tpm")),
        rps=_log_uniform(rng, RPS[0], max(RPS[0], min(RPS[1], MAX_BURST / shape_s))),
        target_s=rng.uniform(*(LONG_TARGET_S if index % LONG_EVERY == 0 else TARGET_S)),
        seed=rng.randrange(1 << 30),
    )


def limits(p: Provider, start: float, burst_s: float) -> list[tuple[object, str]]:
    """What the perfect client obeys, each limit with the dimension it counts: the provider's
    enforcement at the true limit (the phase `start` s into its first window); a pace at
    min(configured, true) with a burst of `burst_s` (the configured limit is a rate
    headers never raise, so the utilisation is that of min(configured, true): a client that
    bursts a provider's bucket or window is not needed to score 1); and the configured ceiling
    (at most a minute's worth in any 60 s)."""
    conf_rpm, conf_tpm = p.configured
    ceiling = {"enforcement": "sliding_window", "window_s": CEILING_S, "now": 0.0}
    paced = {"enforcement": "bucket", "bucket_s": burst_s, "now": 0.0}
    return [
        (make_limit(p.rpm, now=-start, **p.shape), "rpm"),
        (make_limit(p.tpm, now=-start, **p.shape), "tpm"),
        (make_limit(min(p.rpm, conf_rpm), **paced), "rpm"),
        (make_limit(min(p.tpm, conf_tpm), **paced), "tpm"),
        (make_limit(conf_rpm, **ceiling), "rpm"),
        (make_limit(conf_tpm, **ceiling), "tpm"),
    ]


def admission_times(costs, limits):
    """When a perfect client's requests are admitted, in order, the first sent at 0."""
    t = 0.0
    for cost in costs:
        units = {"rpm": 1, "tpm": cost}
        while (wait := max(lim.wait_for(units[d], t) for lim, d in limits)) > 0:
            t += max(wait, 1e-6)  # float rounding can leave a tiny wait forever
        for lim, d in limits:
            lim.take(units[d], t)
        yield t


def size(p: Provider) -> tuple[list[str], list[int], float] | None:
    """Sets the provider's true limits; (prompts, costs, ideal admission of the last) of the
    smallest job whose ideal reaches its target, or None if that passes MAX_IDEAL_S."""
    pool = make_prompts(MAX_PROMPTS, seed=p.seed)
    mean_cost = statistics.fmean(p.cost(x) for x in pool[:200])
    binding = {"rpm": p.rps * 60, "tpm": p.rps * mean_cost * 60}
    other = "tpm" if p.bind == "rpm" else "rpm"
    binding[other] *= SLACK
    p.rpm, p.tpm = max(1, round(binding["rpm"])), max(1, round(binding["tpm"]))
    costs: list[int] = []

    def counted():
        for prompt in pool:
            costs.append(p.cost(prompt))
            yield costs[-1]

    for t in admission_times(counted(), limits(p, 0.0, SIZING_BURST_S)):
        if t > MAX_IDEAL_S:
            return None
        if t >= p.target_s and len(costs) >= MIN_REQUESTS:
            return pool[: len(costs)], costs, t
    return None


def draw_providers(n: int, seed: int):
    """N providers and their jobs; a provider whose job would run too long is drawn again."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        p = draw(rng, len(out) + 1)
        job = size(p)
        if job is not None:
            out.append((p, job))
    return out
