"""Does the queue worker share one key fairly with a batch job, and lose nothing to kill -9?

1. Share: the simulator and the shared limiter at the same requests/min; a queue worker (job
   "worker", weight --worker-weight) serves a full queue while LLMResource.chat_batch (job
   "batch", weight --batch-weight) runs against the same base_url + model + key. Both keep more
   requests in flight than the limit allows (saturation). Over the steady window, each job's
   share of the admitted requests is compared with its weighted share.
2. Kill -9: --messages messages, 3 worker processes (`batch-llm-assets worker`), one killed
   with SIGKILL a third of the way through. Counted in the result list (distinct ids, duplicates)
   and at the simulator (answers, distinct prompts, resends).

    python benchmarks/worker_share.py [--rpm 1200] [--seconds 8] [--messages 300]

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import redis.asyncio as aioredis
from _common import make_prompts, messages

from batch_llm_assets import ChatRequest, LLMResource
from batch_llm_assets.engine import EmbeddedValkey
from batch_llm_assets.engine.outcome import ANSWER_CLASSES
from batch_llm_assets.simulator import SimulatorProcess
from batch_llm_assets.worker import QueueNames, Worker, WorkerSettings, open_parts, submit

MODEL = "sim-1"
KEY = "sk-bench-worker-0123456789"


def request_message(i: int, prompt: str, deadline_s: float = 600) -> dict:
    now = time.time()
    return {
        "id": f"m{i}",
        "created": int(now),
        "deadline": now + deadline_s,
        "payload": {"model": MODEL, "messages": messages(prompt), "max_tokens": 16},
    }


def share_parts(sim_url: str, redis_url: str, args: argparse.Namespace):
    """(queues, the worker's settings, the batch job's LLMResource): two jobs on one key."""
    queues = QueueNames(
        request_sortedset="share:requests",
        retry_sortedset="share:retry",
        result_list="share:results",
    )
    settings = WorkerSettings(
        redis_url=redis_url,
        base_url=sim_url,
        model=MODEL,
        api_key=KEY,
        queues=queues,
        concurrency=args.concurrency,
        batch_size=args.concurrency,
        poll_interval_s=0.05,
        rpm=args.rpm,
        job_key="worker",
        job_weight=args.worker_weight,
        metrics_port=None,
    )
    llm = LLMResource(
        base_url=sim_url,
        api_key=KEY,
        model=MODEL,
        rpm=args.rpm,
        redis_url=redis_url,
        job_key="batch",
        job_weight=args.batch_weight,
        max_concurrency=args.concurrency,
        params={"max_tokens": 16},
    )
    return queues, settings, llm


async def share(sim_url: str, redis_url: str, args: argparse.Namespace) -> dict:
    queues, settings, llm = share_parts(sim_url, redis_url, args)
    # More than the whole run can send, so the queue never empties.
    n = int(args.rpm / 60 * (args.seconds + args.warmup) * 2) + 50
    prompts = make_prompts(n)
    client = aioredis.Redis.from_url(redis_url)
    for i, p in enumerate(prompts):
        await submit(client, request_message(i, p[:400]), sortedset=queues.request_sortedset)
    batch_ok = 0

    async def batch() -> None:
        nonlocal batch_ok
        reqs = (ChatRequest(i, messages(p[:400])) for i, p in enumerate(prompts))
        async for r in llm.chat_batch(reqs):
            # Every answer the provider gave counts (a 16-token cap truncates free text, which
            # a batch row records as failed `truncated`; the worker returns it as a 200).
            batch_ok += r.ok or r.error_class in ANSWER_CLASSES

    async def answered() -> tuple[int, int]:
        return await client.llen(queues.result_list), batch_ok

    stop = asyncio.Event()
    async with open_parts(settings) as parts:
        worker = Worker(settings, parts)
        tasks = [asyncio.create_task(worker.run(stop)), asyncio.create_task(batch())]
        await asyncio.sleep(args.warmup)
        per_s = await per_second(answered, args.seconds)
        tasks[1].cancel()
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    await client.aclose()
    return share_figures(args, per_s)


async def per_second(answered, seconds: float) -> dict[str, list[int]]:
    """Answers per second of the window, per job: a share that drifts or comes in bursts shows
    here, where the window's totals would hide it."""
    per_s: dict[str, list[int]] = {"worker": [], "batch": []}
    (wp, bp), end = await answered(), time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        await asyncio.sleep(min(1.0, left))
        wn, bn = await answered()
        per_s["worker"].append(wn - wp)
        per_s["batch"].append(bn - bp)
        wp, bp = wn, bn
    return per_s


def share_figures(args: argparse.Namespace, per_s: dict[str, list[int]]) -> dict:
    w, b = sum(per_s["worker"]), sum(per_s["batch"])
    want = args.worker_weight / (args.worker_weight + args.batch_weight)
    got = w / max(1, w + b)
    # Each job's relative distance from its weighted share; the smaller share is the stricter.
    errors = {"worker": abs(got / want - 1), "batch": abs((1 - got) / (1 - want) - 1)}
    return {
        "rpm": args.rpm,
        "window_s": args.seconds,
        "weights": {"worker": args.worker_weight, "batch": args.batch_weight},
        "requests": {"worker": w, "batch": b},
        "worker_share": round(got, 3),
        "worker_share_expected": round(want, 3),
        "share_error": {k: round(v, 3) for k, v in errors.items()},
        "utilization": round((w + b) / (args.rpm / 60 * args.seconds), 3),
        "per_second": per_s,
    }


def start_worker(sim_url: str, redis_url: str, queues: QueueNames) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "batch_llm_assets.cli", "worker",
        "--redis.url", redis_url, "--redis.ss.igw-base-url", sim_url, "--model", MODEL,
        "--redis.ss.request-queue-name", queues.request_sortedset,
        "--redis.retry-queue-name", queues.retry_sortedset,
        "--redis.ss.result-queue-name", queues.result_list,
        "--redis.ss.poll-interval-ms", "50", "--visibility-timeout", "2s",
        "--concurrency", "8", "--metrics-port", "0", "--log-level", "WARNING",
    ]  # fmt: skip
    env = {**os.environ, "OPENAI_API_KEY": KEY}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    for _ in range(2):
        if "worker serving" in (proc.stdout.readline() if proc.stdout else ""):
            return proc
    proc.kill()
    raise RuntimeError("worker did not start")


async def kill9(sim: SimulatorProcess, redis_url: str, args: argparse.Namespace) -> dict:
    queues = QueueNames(
        request_sortedset="kill:requests", retry_sortedset="kill:retry", result_list="kill:results"
    )
    sim.configure(rpm=None, latency_ms=args.latency_ms)
    sim.reset()
    client = aioredis.Redis.from_url(redis_url)
    # Workers first, then the messages: all three are serving when the kill comes.
    procs = [start_worker(sim.url, redis_url, queues) for _ in range(3)]
    for i, p in enumerate(make_prompts(args.messages, seed=11)):
        await submit(client, request_message(i, p[:400]), sortedset=queues.request_sortedset)
    started = time.monotonic()
    try:
        while await client.llen(queues.result_list) < args.messages // 3:
            await asyncio.sleep(0.02)
        procs[0].send_signal(signal.SIGKILL)
        held = await client.zcard(f"{queues.request_sortedset}:processing")
        give_up = time.monotonic() + 60
        while await client.llen(queues.result_list) < args.messages:
            if time.monotonic() > give_up:
                break
            await asyncio.sleep(0.05)
        elapsed = time.monotonic() - started
        rows = [json.loads(r) for r in await client.lrange(queues.result_list, 0, -1)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
            if p.stdout:
                p.stdout.close()
    await client.aclose()
    stats = sim.stats()
    ids = [r["id"] for r in rows]
    return {
        "messages": args.messages,
        "workers": 3,
        "killed": 1,
        "processing_at_kill": held,
        "results": len(rows),
        "distinct_ids": len(set(ids)),
        "duplicate_results": len(ids) - len(set(ids)),
        "ok": sum(1 for r in rows if r.get("status_code") == 200),
        "lost": args.messages - len(set(ids)),
        "sim_answered": stats.get("answered", 0),
        "sim_distinct_prompts": stats.get("distinct_prompts", 0),
        "sim_resent": stats.get("resent_prompts", 0),
        "seconds": round(elapsed, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rpm", type=int, default=1200)
    ap.add_argument("--seconds", type=float, default=8.0, help="measured window")
    ap.add_argument(
        "--warmup", type=float, default=6.0, help="seconds before the window: shares settle"
    )
    ap.add_argument("--worker-weight", type=float, default=1.0)
    ap.add_argument("--batch-weight", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=32, help="in flight per job")
    ap.add_argument("--messages", type=int, default=300)
    ap.add_argument("--latency-ms", type=float, default=300.0, help="simulated answer time")
    args = ap.parse_args()
    with (
        EmbeddedValkey() as valkey,
        SimulatorProcess(api_key=KEY, rpm=args.rpm, bucket_s=0.5, latency_ms=20) as sim,
    ):
        shared = asyncio.run(share(sim.url, valkey.url, args))
        shared["sim_rate_limited"] = sim.stats().get("rate_limited", 0)
        killed = asyncio.run(kill9(sim, valkey.url, args))
    out = {
        "benchmark": "worker_share",
        "share": shared,
        "share_within_10pct": max(shared["share_error"].values()) <= 0.10,
        "kill9": killed,
        "kill9_lost_nothing": killed["lost"] == 0 and killed["duplicate_results"] == 0,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
