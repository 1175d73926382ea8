"""A limit configured 20 % too high, with nothing to correct it but the 429s.

The simulator (its own process) enforces 1,200 requests/min in a 1 s bucket and sends no
x-ratelimit-limit-*; LLMResource is told 1,440. Each job sends 240 requests (64 in flight) on a
fresh key, one after the other in one process (the first job of a process and the later ones
have differed). --no-rate-headers also drops x-ratelimit-remaining/reset: then the 429s are
all the engine learns from. The ideal is about 11 s (20 requests at once, then 20 a second).

    python benchmarks/too_high.py [--jobs 4] [--no-rate-headers]

Prints a line per job, and one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import _common  # noqa: F401  (the repo on sys.path, offline tiktoken files)

from batch_llm_assets import ChatRequest, LLMResource
from batch_llm_assets.engine import EmbeddedValkey
from batch_llm_assets.simulator import SimulatorProcess

REQUESTS = 240


def one_job(sim: SimulatorProcess, redis_url: str, k: int, rate_headers: bool) -> dict:
    """Job `k` on a fresh key: REQUESTS requests, LLMResource told 1,440 rpm of a 1,200 limit."""
    key = f"key{k}"
    sim.configure(
        rpm=1200, bucket_s=1.0, limit_header="none", rate_headers=rate_headers, api_key=key
    )
    sim.reset()
    llm = LLMResource(
        base_url=sim.url,
        api_key=key,
        model="sim-1",
        rpm=1440,
        redis_url=redis_url,
        job_key="too-high",
        max_attempts=20,
    )

    async def run() -> list:
        async with llm.engine() as engine:
            reqs = [ChatRequest(i, [{"role": "user", "content": f"h{i}"}]) for i in range(REQUESTS)]
            return [r async for r in engine.map(reqs)]

    started = time.monotonic()
    with llm:
        results = asyncio.run(run())
    return {
        "job": k,
        "wall_s": round(time.monotonic() - started, 2),
        "http_429": sum(r.http_429 for r in results),
        "failed": sum(not r.ok for r in results),
        "sim_429": sim.stats().get("rate_limited", 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--no-rate-headers", dest="rate_headers", action="store_false")
    args = ap.parse_args()
    jobs = []
    with (
        EmbeddedValkey() as valkey,
        SimulatorProcess(api_key="key0", latency_ms=5, latency_per_token_ms=0.05) as sim,
    ):
        for k in range(args.jobs):
            jobs.append(one_job(sim, valkey.url, k, args.rate_headers))
            print(json.dumps(jobs[-1]), flush=True)
    print(
        json.dumps(
            {
                "benchmark": "too_high",
                "rate_headers": args.rate_headers,
                "requests_per_job": REQUESTS,
                "max_http_429": max(j["http_429"] for j in jobs),
                "max_wall_s": max(j["wall_s"] for j in jobs),
                "failed": sum(j["failed"] for j in jobs),
                "jobs": jobs,
            }
        )
    )


if __name__ == "__main__":
    main()
