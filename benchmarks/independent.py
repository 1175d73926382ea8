"""The engine against an independent provider limiter (_independent_provider.py), one server
subprocess per case: OpenAI's token buckets, Azure's 1 s / 10 s periods, a gateway's sliding
window, a fixed window with no headers at all, and a vLLM-like concurrency limit.

    PYTHONPATH=. .venv/bin/python benchmarks/independent.py [--only NAME ...] [--seconds 25]

Utilisation: admitted requests or tokens (the binding one) over min(configured, true) limit x
the time from the first request's arrival to the last admission (vLLM-like: busy slot-seconds
over N x that time). max_true_ratio: the most admitted in any 60 s over the TRUE limit (a run
under 60 s: its whole rate per minute). Prints a table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The repo importable in the spawned engine processes too (they inherit the environment).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
# No internet here: tiktoken's encodings come from ../shared/tiktoken when it exists.
_TIKTOKEN = ROOT.parent / "shared" / "tiktoken"
if _TIKTOKEN.is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(_TIKTOKEN))
sys.path.insert(0, str(ROOT))

# db 13 is this benchmark's own; it is flushed before each case so no limiter state carries over.
REDIS_URL = "redis://127.0.0.1:6379/13"
PROVIDER = Path(__file__).resolve().parent / "_independent_provider.py"
# The answer budget every request asks for; the provider charges it at admission.
MAX_TOKENS = 50
# Traffic per case at the case's ideal rate: long enough for a 10 s window to repeat, short
# enough for ten cases in about six minutes.
DEFAULT_SECONDS = 25.0
# Prompt lengths in words, as the brief asks: short headlines to long paragraphs.
MIN_WORDS, MAX_WORDS = 5, 300
# Varied word lengths, so that chars/4 (the provider) and tiktoken (the engine) disagree as they
# do on real text.
VOCAB_TEXT = (
    "the quarterly earnings report surprised analysts despite weaker consumer demand in "
    "several regions while semiconductor inventories normalised and freight costs eased "
    "a central bank spokesperson declined to comment on speculation about interest rates "
    "municipal bonds outperformed as investors sought shelter from volatility"
)
VOCAB = VOCAB_TEXT.split()
# A server that has not said its port after this long has failed to start.
SERVER_START_S = 20.0
# Limit of one engine process's run of a case, past which it is reported hung.
JOB_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Case:
    name: str
    policy: str
    rpm: int | None = None  # the provider's TRUE limits
    tpm: int | None = None
    conf: float | None = 1.0  # configured = conf x true; None: nothing configured
    window: float = 5.0
    concurrency: int = 0
    start_fill: float = 1.0
    processes: int = 1
    latency: float = 0.05
    provider: str | None = None  # LLMResource.provider; None lets the engine probe the server


CASES = [
    Case("openai_eq", "openai_bucket", 600, 60000, provider="openai"),
    Case("openai_1.2x", "openai_bucket", 600, 60000, 1.2, provider="openai"),
    Case("openai_1.2x_drained", "openai_bucket", 600, 60000, 1.2, start_fill=0.05,
         provider="openai"),
    Case("azure_eq", "azure_periods", 300, 50000, provider="openai"),
    Case("azure_1.1x", "azure_periods", 300, 50000, 1.1, provider="openai"),
    Case("gateway_w5_eq", "gateway_sliding", 600, window=5.0),
    Case("gateway_w5_1.2x", "gateway_sliding", 600, conf=1.2, window=5.0),
    Case("fixed_w10_1.15x", "no_headers_fixed", 600, conf=1.15, window=10.0),
    Case("openai_2proc", "openai_bucket", 600, 60000, processes=2, provider="openai"),
    Case("vllm_n4", "concurrency_like_vllm", conf=None, concurrency=4, latency=0.2),
]  # fmt: skip


def make_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Summarise item {i}: " + " ".join(rng.choices(VOCAB, k=rng.randint(MIN_WORDS, MAX_WORDS)))
        for i in range(n)
    ]


def server_tokens(prompt: str) -> int:
    """What the provider charges for one request (its own rule, restated here to size a case)."""
    messages = [{"role": "user", "content": prompt}]
    return math.ceil(len(json.dumps(messages)) / 4) + MAX_TOKENS


def size_case(case: Case, seconds: float, seed: int) -> list[str]:
    """Prompts for about `seconds` of traffic at min(configured, true) of the binding limit."""
    pool = make_prompts(4000, seed)
    if case.policy == "concurrency_like_vllm":
        return pool[: int(seconds * case.concurrency / (case.latency + 0.01))]
    scale = min(case.conf or 1.0, 1.0)
    mean_tokens = statistics.mean(server_tokens(p) for p in pool)
    rows = start_credit(case, case.rpm) + case.rpm * scale / 60 * seconds
    if case.tpm:
        tokens = start_credit(case, case.tpm) + case.tpm * scale / 60 * seconds
        rows = min(rows, tokens / mean_tokens)
    return pool[: int(rows)]


def start_credit(case: Case, limit: int) -> float:
    """What an idle key may spend at once before any rate applies: an OpenAI bucket starts
    with `start_fill` of a minute's limit; the window policies start with nothing extra."""
    return case.start_fill * limit if case.policy == "openai_bucket" else 0.0


def rate_metrics(case: Case, adm: list[list[float]], elapsed: float) -> dict:
    """Utilisation and the ratio to the true limit of the binding dimension, each plain (the
    brief's formula) and net of the bucket's start credit (the steady rate a bucket allows)."""
    dims = [(0, case.rpm)] + ([(1, case.tpm)] if case.tpm else [])
    out = {"utilization": 0.0, "utilization_plain": 0.0}
    out |= {"max_true_ratio": 0.0, "max_true_ratio_plain": 0.0}
    if not elapsed:
        return out
    for index, true in dims:
        total = sum(row[1] for row in adm) if index else len(adm)
        credit = start_credit(case, true)
        limit = min(true, true * case.conf) if case.conf else true
        if elapsed >= 60:  # the busiest 60 s
            most = window_max(adm, index, 60.0)
            net = most - credit
        else:  # the whole run's rate per minute
            most, net = total * 60 / elapsed, (total - credit) * 60 / elapsed
        metrics = {
            "utilization": total / (credit + limit / 60 * elapsed),
            "utilization_plain": total / (limit / 60 * elapsed),
            "max_true_ratio": net / true,
            "max_true_ratio_plain": most / true,
        }
        out = {k: max(out[k], round(v, 3)) for k, v in metrics.items()}
    return out


def start_server(case: Case) -> tuple[subprocess.Popen, int]:
    argv = [sys.executable, str(PROVIDER), "--policy", case.policy, "--latency", str(case.latency)]
    argv += ["--window", str(case.window), "--start-fill", str(case.start_fill)]
    argv += ["--rpm", str(case.rpm)] if case.rpm else []
    argv += ["--tpm", str(case.tpm)] if case.tpm else []
    argv += ["--concurrency", str(case.concurrency)] if case.concurrency else []
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("PORT "):
            return proc, int(line.split()[1])
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"the provider for {case.name} did not start")


def http_json(port: int, path: str, method: str = "GET") -> dict:
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    with urllib.request.urlopen(req, timeout=10) as answer:
        return json.loads(answer.read())


def engine_job(port: int, case: dict, prompts: list[str], first_id: int, barrier, out) -> None:
    """One engine process: waits at the barrier, sends its rows, puts a summary on `out`."""
    import logging

    from batch_llm_assets import ChatRequest, LLMResource

    logging.basicConfig(level=logging.WARNING)
    conf = case["conf"]
    llm = LLMResource(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="sk-test",
        model="gpt-4o-mini",
        provider=case["provider"],
        rpm=round(case["rpm"] * conf) if conf and case["rpm"] else None,
        tpm=round(case["tpm"] * conf) if conf and case["tpm"] else None,
        redis_url=REDIS_URL,
        job_key=case["name"].replace(".", "_"),
        max_attempts=20,
        max_concurrency=64,
        params={"max_tokens": MAX_TOKENS},
    )
    reqs = [
        ChatRequest(first_id + i, [{"role": "user", "content": p}]) for i, p in enumerate(prompts)
    ]

    async def run() -> list:
        async with llm.engine() as engine:
            barrier.wait()
            return [r async for r in engine.map(reqs)]

    with llm:
        results = asyncio.run(run())
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = f"{r.error_class}: {(r.error_message or '')[:80]}"
            errors[key] = errors.get(key, 0) + 1
    out.put(
        {
            "rows": len(results),
            "failed": sum(not r.ok for r in results),
            "client_429": sum(r.http_429 for r in results),
            "max_attempts": max((r.attempts for r in results), default=0),
            "errors": errors,
        }
    )


def run_engines(case: Case, port: int, prompts: list[str]) -> list[dict]:
    """The case's engine processes (spawned, sharing one job_key), started together."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(case.processes + 1), ctx.Queue()
    share = math.ceil(len(prompts) / case.processes)
    procs = []
    for k in range(case.processes):
        part = prompts[k * share : (k + 1) * share]
        args = (port, asdict(case), part, k * share, barrier, out)
        procs.append(ctx.Process(target=engine_job, args=args))
    for proc in procs:
        proc.start()
    barrier.wait(timeout=120)  # the server is fresh: everything it counts is the engines'
    summaries = [out.get(timeout=JOB_TIMEOUT_S) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    return summaries


def window_max(admissions: list[list[float]], index: int, span: float) -> float:
    """The most of column `index` (0: requests, 1: tokens) admitted in any `span` s."""
    best, total, lo = 0.0, 0.0, 0
    for row in admissions:
        total += row[index] if index else 1
        while admissions[lo][0] <= row[0] - span:
            total -= admissions[lo][index] if index else 1
            lo += 1
        best = max(best, total)
    return best


def analyse(case: Case, stats: dict, summaries: list[dict]) -> dict:
    adm = sorted(stats["admissions"])
    elapsed = (adm[-1][0] - stats["first_received"]) if adm else 0.0
    if case.policy == "concurrency_like_vllm":
        util = round(stats["busy_s"] / (case.concurrency * elapsed), 3) if elapsed else 0.0
        metrics = {"utilization": util, "utilization_plain": util}
        metrics |= {"max_true_ratio": None, "max_true_ratio_plain": None}
    else:
        metrics = rate_metrics(case, adm, elapsed)
    errors: dict[str, int] = {}
    for s in summaries:
        for k, v in s["errors"].items():
            errors[k] = errors.get(k, 0) + v
    return {
        "case": case.name,
        "policy": case.policy,
        "rows": sum(s["rows"] for s in summaries),
        "elapsed_s": round(elapsed, 2),
        **{k: metrics[k] for k in ("utilization", "utilization_plain")},
        "received": stats["received"],
        "admitted": stats["admitted"],
        "server_429": stats["rate_limited"],
        "client_429": sum(s["client_429"] for s in summaries),
        "rate_limited_share": round(stats["rate_limited"] / max(1, stats["received"]), 3),
        "failed_rows": sum(s["failed"] for s in summaries),
        "max_attempts": max(s["max_attempts"] for s in summaries),
        **{k: metrics[k] for k in ("max_true_ratio", "max_true_ratio_plain")},
        "max_in_flight": stats["max_in_flight"],
        "errors": errors,
    }


def run_case(case: Case, seconds: float, seed: int) -> dict:
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()
    prompts = size_case(case, seconds, seed)
    proc, port = start_server(case)
    try:
        summaries = run_engines(case, port, prompts)
        stats = http_json(port, "/stats")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    return analyse(case, stats, summaries)


COLUMNS = (
    ("case", 20),
    ("rows", 5),
    ("elapsed_s", 9),
    ("utilization", 11),
    ("server_429", 10),
    ("rate_limited_share", 18),
    ("failed_rows", 11),
    ("max_attempts", 12),
    ("max_true_ratio", 14),
    ("utilization_plain", 17),
    ("max_true_ratio_plain", 20),
    ("max_in_flight", 13),
)


def print_table(rows: list[dict]) -> None:
    print(" ".join(name.rjust(width) for name, width in COLUMNS))
    for row in rows:
        print(" ".join(str(row[name]).rjust(width) for name, width in COLUMNS))
    for row in rows:
        if row["errors"]:
            print(f"{row['case']}: failures {row['errors']}")


def summary(rows: list[dict]) -> dict:
    utils = [r["utilization"] for r in rows]
    shares = [r["rate_limited_share"] for r in rows]
    ratios = [r["max_true_ratio"] for r in rows if r["max_true_ratio"] is not None]
    return {
        "cases": len(rows),
        "median_utilization": round(statistics.median(utils), 3),
        "worst_utilization": min(utils),
        "rate_limited_share": round(
            sum(r["server_429"] for r in rows) / max(1, sum(r["received"] for r in rows)), 4
        ),
        "worst_rate_limited_share": max(shares),
        "failed_rows": sum(r["failed_rows"] for r in rows),
        "max_true_ratio": max(ratios) if ratios else None,
        "per_case": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    parser.add_argument("--seconds", type=float, default=DEFAULT_SECONDS)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    rows = []
    for case in CASES:
        if args.only and case.name not in args.only:
            continue
        started = time.monotonic()
        rows.append(run_case(case, args.seconds, args.seed))
        print(f"# {case.name}: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    print_table(rows)
    print(json.dumps(summary(rows)))


if __name__ == "__main__":
    main()
