"""The matrix of utilization.py: one quick job per provider shape, in one process.

A cell = enforcement x bind x configured/true x token counting, each with x-ratelimit-limit-*
per minute; the cells configured too high (1.2) run again without it ("/nolimit": nothing tells
the engine its configured limit is wrong but the remaining/reset headers and the 429s). The
simulator (its own process) enforces the true limit in the cell's way; LLMResource is told
configured = true x ratio. The ideal counts the provider's bucket: a perfect client sending
the same requests in order at the earliest instant the provider (at min(configured, true))
admits each; a job that fits in a 60 s bucket has an ideal near zero, so its wall time is held
to ideal + SLACK_S.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import threading
import time

from _common import make_prompts, messages

from batch_llm_assets import ChatRequest, LLMResource
from batch_llm_assets.engine import count_prompt_tokens
from batch_llm_assets.simulator.counting import chars4_tokens
from batch_llm_assets.simulator.limits import make_limit

MODEL = "gpt-4o-mini"
MAX_TOKENS = 64
# enforcement name -> simulator settings, and the seconds of the limit it admits at once.
ENFORCEMENTS = {
    "bucket1s": ({"enforcement": "bucket", "bucket_s": 1.0}, 1.0),
    "bucket10s": ({"enforcement": "bucket", "bucket_s": 10.0}, 10.0),
    "bucket60s": ({"enforcement": "bucket", "bucket_s": 60.0}, 60.0),
    "fixed10s": ({"enforcement": "fixed_window", "window_s": 10.0}, 10.0),
    "sliding10s": ({"enforcement": "sliding_window", "window_s": 10.0}, 10.0),
    "quantized1s": ({"enforcement": "quantized", "quantum_s": 1.0}, 1.0),
}
BINDS = ("tpm", "rpm")
RATIOS = (1.0, 1.2, 0.8)
COUNTINGS = ("tiktoken", "chars4")
# x-ratelimit-limit-* as the simulator sends it; "none" only where it matters (ratio 1.2).
LIMIT_HEADERS = {"per_minute": "", "none": "nolimit"}
SLACK_S = 1.0  # latency and start-up a job that fits in the bucket still takes
STALL_MAX_429 = 5  # --stall-s: 429s allowed after a stall of the event loop (issue 10)


def _cost(prompt: str, counting: str) -> int:
    msgs = messages(prompt)
    if counting == "chars4":
        import json

        return chars4_tokens(json.dumps(msgs)) + MAX_TOKENS
    return count_prompt_tokens(msgs, MODEL) + MAX_TOKENS


def ideal_s(costs: list[int], per_min: int, shape: dict, dim: str, start: float = 0.0) -> float:
    """When a perfect client's last request is admitted by the provider at `per_min`, its first
    sent `start` s into the provider's first window (a fixed window's phase at the first send)."""
    limit = make_limit(per_min, now=-start, **shape)
    t = 0.0
    for c in costs:
        cost = c if dim == "tpm" else 1
        while (w := limit.wait_for(cost, t)) > 0:
            t += max(w, 1e-6)  # float rounding can leave a tiny wait forever
        limit.take(cost, t)
    return t


def cell_limits(costs, shape_s: float, bind: str, target_s: float):
    """True (rpm, tpm) for a job whose binding part lasts about target_s beyond the burst."""
    work = sum(costs) if bind == "tpm" else len(costs)
    per_min = int(work * 60 / (target_s + shape_s))
    other = (len(costs) if bind == "tpm" else sum(costs)) * 60 / (target_s + shape_s) * 3
    return (int(other), per_min) if bind == "tpm" else (per_min, int(other))


async def _run_job(llm: LLMResource, prompts: list[str], stall_s: float) -> dict:
    ok = n429 = failed = 0
    reqs = (ChatRequest(i, messages(p)) for i, p in enumerate(prompts))
    stall = None
    if stall_s:

        async def stall_loop():
            await asyncio.sleep(1.0)
            time.sleep(stall_s)  # block the event loop, as a long GC or a busy callback

        stall = asyncio.create_task(stall_loop())
    started = time.monotonic()
    async for r in llm.chat_batch(reqs):
        ok += r.ok
        failed += not r.ok
        n429 += r.http_429
    wall = time.monotonic() - started
    if stall is not None:
        await stall
    return {"ok": ok, "failed": failed, "http_429": n429, "wall_s": wall}


def run_cell(
    sim,
    redis_url,
    enforcement,
    bind,
    ratio,
    counting,
    limit_header="per_minute",
    *,
    requests,
    target_s,
    stall_s,
):
    import redis

    shape, shape_s = ENFORCEMENTS[enforcement]
    prompts = make_prompts(requests)
    # tiktoken's files load once per process (0.3 s), inside the first job unless loaded here:
    # `--cell .../chars4` would otherwise time its first run 0.3 s slow.
    count_prompt_tokens(messages("warm up"), MODEL)
    costs = [_cost(p, counting) for p in prompts]
    rpm, tpm = cell_limits(costs, shape_s, bind, target_s)
    sim.configure(rpm=rpm, tpm=tpm, counting=counting, limit_header=limit_header, **shape)
    sim.reset()
    redis.Redis.from_url(redis_url).flushdb()
    llm = LLMResource(
        base_url=sim.url,
        model=MODEL,
        params={"max_tokens": MAX_TOKENS},
        redis_url=redis_url,
        rpm=int(rpm * ratio),
        tpm=int(tpm * ratio),
        max_concurrency=64,
        max_attempts=20,
    )
    # A clean heap for each cell: the garbage of the cells before (their results, engines,
    # connections) otherwise lands a full collection, a 0.1 s stall of the event loop, in
    # whichever cell crosses the threshold (the third, bucket1s/tpm/1.2/tiktoken: 0.94 of the
    # limit in every run, 0.98 alone or with the collector off).
    gc.collect()
    gc.freeze()
    res = asyncio.run(_run_job(llm, prompts, stall_s))
    true = tpm if bind == "tpm" else rpm
    stats = sim.stats()
    start = (stats["first_received_at"] or stats["started_at"]) - stats["started_at"]
    ideal = ideal_s(costs, int(true * min(1.0, ratio)), shape, bind, start)
    return {
        "enforcement": enforcement,
        "bind": bind,
        "ratio": ratio,
        "counting": counting,
        "limit_header": limit_header,
        "requests": requests,
        **res,
        "wall_s": round(res["wall_s"], 2),
        "ideal_s": round(ideal, 2),
        "wall_over_ideal": round(res["wall_s"] / max(ideal, SLACK_S), 3),
        "utilization": round(min(1.0, max(ideal, SLACK_S) / res["wall_s"]), 3),
        "pct_429": round(100 * res["http_429"] / requests, 2),
    }


def cells(only: str | None):
    for limit_header, enforcement, bind, ratio, counting in itertools.product(
        LIMIT_HEADERS, ENFORCEMENTS, BINDS, RATIOS, COUNTINGS
    ):
        if limit_header != "per_minute" and ratio != 1.2:
            continue
        name = f"{enforcement}/{bind}/{ratio}/{counting}"
        if LIMIT_HEADERS[limit_header]:
            name += "/" + LIMIT_HEADERS[limit_header]
        if only is None or all(part in name.split("/") for part in only.split("/")):
            yield enforcement, bind, ratio, counting, limit_header


def meets(cell: dict) -> bool:
    return (
        cell["utilization"] >= 0.95
        and cell["wall_over_ideal"] <= 1.1
        and cell["pct_429"] <= 0.5
        and cell["failed"] == 0
    )


def worst(results: list[dict]) -> dict:
    return min(results, key=lambda c: (meets(c), c["utilization"], -c["pct_429"]))


def print_table(results: list[dict]) -> None:
    cols = (
        "enforcement",
        "bind",
        "ratio",
        "counting",
        "limit_header",
        "ok",
        "failed",
        "http_429",
        "pct_429",
        "wall_s",
        "ideal_s",
        "wall_over_ideal",
        "utilization",
    )
    print(" | ".join(cols) + " | meets")
    for c in results:
        print(" | ".join(str(c[k]) for k in cols) + f" | {'yes' if meets(c) else 'NO'}")


_ = threading  # the stall blocks the loop's thread on purpose; nothing else runs threads
