"""Does the adaptive concurrency limit find a self-hosted server's best concurrency, abandon no
answer, and let two runs share the server?

The simulator as a self-hosted server: --slots decode slots (requests beyond them queue inside
it), each request `--latency-ms` + `--per-token-ms` per answer token, the per-token time 2 % slower
per other sequence in the batch (continuous batching), no rate-limit headers.

1. Fixed: LLMResource with `adaptive_concurrency=False` at each --sweep concurrency, --rows
   rows each: the best rows/s is the target.
2. Adaptive: the same rows with the adaptive limit (max_concurrency 64, the generic profile's):
   its rows/s over the best fixed (`ratio`, target >= 0.9), and the answers the simulator
   computed for clients that had given up (`abandoned_answers`, target 0).
3. Two runs: two processes, --rows rows each, on the same server, sharing the limit through
   one Redis (an embedded Valkey): their rows together over the span from the first one's start
   to the last one's end, over the best fixed (`two_runs_ratio`); their abandoned answers are
   added to `abandoned_answers`.

    python benchmarks/self_hosted.py [--slots 8] [--rows 600] [--sweep 4,8,12,16,24,32,64]

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

from _common import make_prompts, messages

from batch_llm_assets import ChatRequest, LLMResource
from batch_llm_assets.engine import EmbeddedValkey
from batch_llm_assets.simulator import SimulatorProcess

MODEL = "sim-1"


async def _run(resource: LLMResource, rows: int, offset: int) -> dict:
    prompts = make_prompts(offset + rows)[offset:]
    reqs = [ChatRequest(offset + i, messages(p)) for i, p in enumerate(prompts)]
    ok = 0
    start = time.time()
    async with resource.engine() as engine:
        async for result in engine.map(reqs):
            ok += result.ok
        gate = engine.gate
        end = time.time()
    return {
        "rows": rows,
        "ok": ok,
        "start": start,
        "end": end,
        "rows_per_s": rows / (end - start),
        "final_limit": gate.limit if gate else None,
        "peak_limit": gate.peak_limit if gate else None,
    }


def run_rows(url: str, *, rows: int, concurrency: int, adaptive: bool, **kw) -> dict:
    resource = LLMResource(
        base_url=url,
        model=MODEL,
        max_concurrency=concurrency,
        adaptive_concurrency=adaptive,
        params={"max_tokens": 32},
        context_window=16_384,
        **kw,
    )
    return asyncio.run(_run(resource, rows, 0))


def two_runs(url: str, redis_url: str, rows: int) -> list[dict]:
    """Two processes on one server, one Redis: each prints its figures as one JSON line."""
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", url, redis_url, str(rows), str(i * rows)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in (1, 2)
    ]
    out = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=600)
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def child(url: str, redis_url: str, rows: int, offset: int) -> None:
    resource = LLMResource(
        base_url=url,
        model=MODEL,
        redis_url=redis_url,
        params={"max_tokens": 32},
        context_window=16_384,
    )
    print(json.dumps(asyncio.run(_run(resource, rows, offset))), flush=True)


def fixed_sweep(sim: SimulatorProcess, args: argparse.Namespace) -> dict[int, dict]:
    """Rows/s at each fixed concurrency of the sweep (adaptive limit off)."""
    fixed = {}
    for c in (int(x) for x in args.sweep.split(",")):
        sim.reset()
        fixed[c] = run_rows(sim.url, rows=args.rows, concurrency=c, adaptive=False)
        st = sim.stats()
        print(
            f"fixed {c:3d}: {fixed[c]['rows_per_s']:6.1f} rows/s, "
            f"{st['max_concurrent']} in the server at most, "
            f"{st['abandoned_answers']} abandoned",
            flush=True,
        )
    return fixed


def adaptive_run(sim: SimulatorProcess, args: argparse.Namespace) -> tuple[dict, int]:
    """The adaptive limit's run, and the answers the server computed for nobody."""
    sim.reset()
    adaptive = run_rows(sim.url, rows=args.rows, concurrency=64, adaptive=True)
    st = sim.stats()
    print(
        f"adaptive: {adaptive['rows_per_s']:6.1f} rows/s, limit {adaptive['final_limit']} "
        f"(peak {adaptive['peak_limit']}), {st['max_concurrent']} in the server at most, "
        f"{st['abandoned_answers']} abandoned",
        flush=True,
    )
    return adaptive, st["abandoned_answers"]


def shared_runs(sim: SimulatorProcess, args: argparse.Namespace) -> tuple[float, int]:
    """Two processes sharing the server through one Redis: rows/s together, answers abandoned."""
    sim.reset()
    with EmbeddedValkey() as valkey:
        runs = two_runs(sim.url, valkey.url, args.rows)
    st = sim.stats()
    span = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    two_rps = sum(r["rows"] for r in runs) / span
    each = ", ".join(f"{r['rows_per_s']:.1f}" for r in runs)
    print(
        f"two runs: {two_rps:6.1f} rows/s together ({each} each, limits "
        f"{[r['final_limit'] for r in runs]}), {st['max_concurrent']} in the server at "
        f"most, {st['abandoned_answers']} abandoned",
        flush=True,
    )
    return two_rps, st["abandoned_answers"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--latency-ms", type=float, default=60.0)
    ap.add_argument("--per-token-ms", type=float, default=1.5)
    ap.add_argument("--sweep", default="4,8,12,16,24,32,64")
    ap.add_argument("--child", nargs=4, metavar=("URL", "REDIS", "ROWS", "OFFSET"))
    args = ap.parse_args()
    if args.child:
        url, redis_url, rows, offset = args.child
        child(url, redis_url, int(rows), int(offset))
        return
    sim_settings = {
        "decode_slots": args.slots,
        "latency_ms": args.latency_ms,
        "latency_per_token_ms": args.per_token_ms,
        "decode_slowdown": 0.02,
        "jitter": 0.1,
    }
    with SimulatorProcess(**sim_settings) as sim:
        fixed = fixed_sweep(sim, args)
        best = max(fixed, key=lambda c: fixed[c]["rows_per_s"])
        best_rps = fixed[best]["rows_per_s"]
        adaptive, abandoned = adaptive_run(sim, args)
        two_rps, abandoned_two = shared_runs(sim, args)
    out = {
        "best_fixed_concurrency": best,
        "best_fixed_rows_per_s": round(best_rps, 1),
        "adaptive_rows_per_s": round(adaptive["rows_per_s"], 1),
        "ratio": round(adaptive["rows_per_s"] / best_rps, 3),
        "abandoned_answers": abandoned + abandoned_two,
        "two_runs_ratio": round(two_rps / best_rps, 3),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
