"""How close to the provider's limit does LLMResource run, and how fairly do K processes share it?

Sends N requests of varied prompt sizes to the simulator (its own process) through LLMResource,
with the simulator and the limiter set to the same limits, TPM binding (or RPM with --bind rpm).
Utilization is measured at the simulator: tokens (or requests) it admitted per second over the
steady part of the run, divided by the limit. Prints one JSON line last.

    python benchmarks/utilization.py [--requests 3000] [--processes 4] [--bind rpm]

--matrix runs one quick job per provider shape (benchmarks/_matrix.py: enforcement x bind x
configured/true x token counting, and the cells configured 1.2x too high again without
x-ratelimit-limit-*, named .../nolimit), prints a table and, last, one JSON line with the worst
cell; --cell picks cells (e.g. bucket60s/tpm, or nolimit), --repeat runs each of them again,
--stall-s blocks the event loop mid-run:

    python benchmarks/utilization.py --matrix [--cell bucket1s/tpm/1.0] [--repeat 5] [--stall-s 2]

--random N --seed S runs N providers drawn from wide ranges (benchmarks/_randomized.py says
what is drawn and defines its figures), prints a table and, last, one JSON line. --cpu-hog K
runs K busy processes beside the headline run (and is the number a random provider's hog uses):

    python benchmarks/utilization.py --random 40 --seed 1
    python benchmarks/utilization.py --cpu-hog 8 [--processes 4] [--bind rpm]

The headline run's JSON line has `believed_rpm` / `believed_tpm`: the limits the engine's
limiter believes at the end of the run (the lowest over the processes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import time
from collections.abc import Iterator

from _common import cpu_hogs, make_prompts, messages

from batch_llm_assets import ChatRequest, LLMResource
from batch_llm_assets.engine import EmbeddedValkey, count_prompt_tokens
from batch_llm_assets.simulator import SimulatorProcess

MODEL = "sim-1"
MAX_TOKENS = 64


def run_worker(url, redis_url, limits, job, prompts, q, ready, go) -> None:
    llm = LLMResource(
        base_url=url,
        model=MODEL,
        params={"max_tokens": MAX_TOKENS},
        redis_url=redis_url,
        job_key=job,
        max_concurrency=64,
        **limits,
    )

    async def main() -> dict:
        ready.release()
        go.wait()  # all processes start together, so throughputs compare
        start = time.time()
        ok = n429 = tokens = 0
        reqs = (ChatRequest(i, messages(p)) for i, p in enumerate(prompts))
        async with llm.engine() as engine:
            async for r in engine.map(reqs):
                ok += r.ok
                n429 += r.http_429
                tokens += (r.prompt_tokens or 0) + MAX_TOKENS
            believed = (engine.limiter.rpm, engine.limiter.tpm)
        return {
            "believed_rpm": believed[0],
            "believed_tpm": believed[1],
            "job": job,
            "ok": ok,
            "http_429": n429,
            "tokens": tokens,
            "start": start,
            "end": time.time(),
            "requests": len(prompts),
        }

    q.put(asyncio.run(main()))


def steady_rate(series: list[dict], key: str) -> tuple[float, int]:
    """Mean per-second admissions, leaving out the first and the last two seconds."""
    if not series:
        return 0.0, 0
    by_t = {s["t"]: s[key] for s in series}
    seconds = list(range(min(by_t), max(by_t) + 1))
    steady = seconds[2:-2] if len(seconds) > 6 else seconds
    return sum(by_t.get(t, 0) for t in steady) / max(1, len(steady)), len(steady)


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--bind", choices=["tpm", "rpm"], default="tpm")
    ap.add_argument("--target-s", type=float, default=45.0, help="ideal duration of the job")
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL"))
    ap.add_argument("--matrix", action="store_true", help="every provider shape, one job each")
    ap.add_argument("--cell", help="matrix cells whose name has these parts, e.g. bucket1s/rpm")
    ap.add_argument("--stall-s", type=float, default=0.0, help="block the event loop mid-run")
    ap.add_argument("--cell-requests", type=int, default=300, help="requests per matrix cell")
    ap.add_argument("--cell-target-s", type=float, default=3.0, help="binding part of a cell")
    ap.add_argument("--repeat", type=int, default=1, help="run each matrix cell this many times")
    ap.add_argument("--random", type=int, default=0, help="N providers drawn at random")
    ap.add_argument("--seed", type=int, default=1, help="the seed of --random's draws")
    ap.add_argument("--cpu-hog", type=int, default=0, help="K busy processes beside the run")
    ap.add_argument("--only", help="with --random: run only these providers of the draw, 2,7")
    args = ap.parse_args()
    if args.random < 0 or args.cpu_hog < 0:
        ap.error("--random and --cpu-hog take a count >= 0")
    if args.random:
        randomized(args)
        return
    if args.matrix or args.stall_s:
        with cpu_hogs(args.cpu_hog):
            matrix(args)
        return
    with cpu_hogs(args.cpu_hog):
        headline(args)


def headline_limits(args, prompts: list[str]) -> tuple[int, int, float]:
    """(rpm, tpm, ideal_s): the binding limit sized so the job ideally takes target_s."""
    total_tokens = sum(count_prompt_tokens(messages(p), MODEL) + MAX_TOKENS for p in prompts)
    if args.bind == "tpm":
        tpm = int(total_tokens / args.target_s * 60)
        rpm = int(args.requests / args.target_s * 60 * 3)  # slack: tokens bind
        return rpm, tpm, total_tokens / (tpm / 60)
    rpm = int(args.requests / args.target_s * 60)
    tpm = int(total_tokens / args.target_s * 60 * 3)
    return rpm, tpm, args.requests / (rpm / 60)


@contextlib.contextmanager
def redis_url_for(args) -> Iterator[str]:
    """--redis-url, else an embedded Valkey for the run; emptied first."""
    import redis

    valkey = None if args.redis_url else EmbeddedValkey().start()
    try:
        url = args.redis_url or valkey.url
        redis.Redis.from_url(url).flushdb()
        yield url
    finally:
        if valkey is not None:
            valkey.stop()


def run_processes(url, redis_url, limits, prompts, k) -> tuple[list[dict], float]:
    """K spawned clients, each every K-th prompt, started together; (results, wall_s)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ready, go = ctx.Semaphore(0), ctx.Event()
    procs = [
        ctx.Process(
            target=run_worker, args=(url, redis_url, limits, f"job{i}", prompts[i::k], q, ready, go)
        )
        for i in range(k)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire()
    t0 = time.time()
    go.set()
    results = [q.get() for _ in procs]
    for p in procs:
        p.join()
    return results, time.time() - t0


def headline(args) -> None:
    prompts = make_prompts(args.requests)
    rpm, tpm, ideal_s = headline_limits(args, prompts)
    limits = {"rpm": rpm, "tpm": tpm}
    with (
        redis_url_for(args) as redis_url,
        SimulatorProcess(rpm=rpm, tpm=tpm, latency_ms=50, latency_per_token_ms=1) as sim,
    ):
        results, wall = run_processes(sim.url, redis_url, limits, prompts, args.processes)
        stats = sim.stats()

    key, limit = ("tokens", tpm) if args.bind == "tpm" else ("requests", rpm)
    rate, n_steady = steady_rate(stats["series"], key)
    start = min(r["start"] for r in results)
    figures = {
        "utilization": round(rate / (limit / 60), 4),
        "rate_limited": sum(r["http_429"] for r in results),
        "requests": args.requests,
        "ok": sum(r["ok"] for r in results),
        "wall_s": round(wall, 2),
        "ideal_s": round(ideal_s, 2),
        "bind": args.bind,
        "rpm": rpm,
        "tpm": tpm,
        "processes": args.processes,
        "steady_seconds": n_steady,
        "sim_429": stats.get("rate_limited", 0),
        "cpu_hog": args.cpu_hog,
        "believed_rpm": min(r["believed_rpm"] for r in results),
        "believed_tpm": min(r["believed_tpm"] for r in results),
    }
    if args.processes > 1:
        field = "tokens" if args.bind == "tpm" else "requests"
        figures["jain_fairness"] = round(jain([r[field] / (r["end"] - start) for r in results]), 4)
    print(json.dumps(figures))


def randomized(args) -> None:
    import _randomized

    with redis_url_for(args) as redis_url, SimulatorProcess(**_randomized.LATENCY) as sim:
        figures = _randomized.main(args, sim=sim, redis_url=redis_url)
    print(json.dumps(figures))


def matrix(args) -> None:
    import _matrix as M

    only = args.cell if args.matrix else (args.cell or "bucket1s/tpm/1.0/tiktoken")
    results = []
    with (
        redis_url_for(args) as redis_url,
        SimulatorProcess(latency_ms=20, latency_per_token_ms=0.2) as sim,
    ):
        for cell in (c for c in M.cells(only) for _ in range(args.repeat)):
            r = M.run_cell(
                sim,
                redis_url,
                *cell,
                requests=args.cell_requests,
                target_s=args.cell_target_s,
                stall_s=args.stall_s,
            )
            results.append(r)
            print(json.dumps(r), flush=True)
    M.print_table(results)
    worst = M.worst(results)
    figures = {
        "cells": len(results),
        "all_meet": all(map(M.meets, results)),
        "stall_s": args.stall_s,
        "worst": worst,
    }
    if args.stall_s:
        # The stall's own target: its wall time includes the stall, so the cells' targets
        # (utilisation, wall / ideal) do not apply; 429s and failed rows do.
        figures["stall_http_429"] = max(r["http_429"] for r in results)
        figures["stall_meets"] = all(
            r["http_429"] <= M.STALL_MAX_429 and r["failed"] == 0 for r in results
        )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
