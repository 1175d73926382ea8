"""Embeddings through the asset against the simulator: utilisation of a TPM limit and its 429s,
requests per row with the default packing, rows/s with no limit, and peak RSS at N vs N/10 rows.

    python benchmarks/embeddings.py [--rows 100000] [--tpm 1000000] [--dimensions 256]

Each figure comes from one daily partition of a DuckDB table of distinct headlines (every row is
sent), materialised by build_llm_embedding_asset with its default packing, each run in a process
of its own (peak RSS is that process's maximum resident set):
- the LLM resource is told the provider is OpenAI, the model's: vectors travel as base64 of
  float32, as the openai SDK asks for them;
- limited: the simulator enforces `--tpm` (a 1 s bucket) and the LLM resource is told the same;
  utilization = tokens admitted per second at the simulator in the steady seconds / (tpm / 60);
  rate_limited_share = the simulator's 429s / the requests it received;
- unlimited: no limits, no latency: rows / the run's wall time, at N rows, and the peak RSS of
  that run over the peak RSS of the same run at N/10 rows (DuckDB's buffer pool capped at
  64 MB: uncapped, it keeps the vectors it wrote, up to 80 % of RAM).
Last line: {"rows", "requests", "utilization", "rate_limited_share", "rows_per_s_unlimited",
"rss_ratio_100k_10k"}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import _common  # noqa: F401 - puts the repo on sys.path, sets TIKTOKEN_CACHE_DIR
import dagster as dg
from partition_memory import make_table
from utilization import steady_rate

from batch_llm_assets import DuckDBWarehouse, LLMResource, SourceTable, build_llm_embedding_asset
from batch_llm_assets.simulator import SimulatorProcess

MODEL = "text-embedding-3-small"
DUCKDB_CONFIG = {"memory_limit": "64MB"}


def one_run(rows: int, tpm: int | None, dimensions: int) -> dict:
    """One partition of `rows` distinct headlines embedded; the simulator's and the run's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "bench.duckdb")
        # The table is made in a process of its own: DuckDB's allocator keeps what it took to
        # build it, and this process's peak RSS is to be the run's.
        subprocess.run(
            [sys.executable, __file__, "--make-table", db, "--rows", str(rows)], check=True
        )
        asset = build_llm_embedding_asset(
            name="bench",
            source=SourceTable(table="headlines", partition_column="published_at"),
            text="{{ headline }}",
            output="bench_embeddings",
            model=MODEL,
            dimensions=dimensions,
            partitions_def=dg.DailyPartitionsDefinition(start_date="2026-11-01"),
        )
        latency = {"latency_ms": 20, "latency_per_token_ms": 0} if tpm else {"latency_ms": 0}
        with SimulatorProcess(tpm=tpm, jitter=0, **latency) as sim:
            resources = {
                "llm": LLMResource(
                    base_url=sim.url,
                    model="gpt-4o-mini",
                    tpm=tpm,
                    adaptive_concurrency=False,
                    provider="openai",
                ),
                # DuckDB keeps the table it writes in its buffer pool, up to its memory_limit
                # (default: 80 % of RAM): capped, so peak RSS shows the run's own memory.
                "warehouse": DuckDBWarehouse(database=db, connection_config=DUCKDB_CONFIG),
            }
            result = dg.materialize([asset], resources=resources, partition_key="2026-11-01")
            stats = sim.stats()
    md = result.asset_materializations_for_node("bench")[0].metadata
    if md["partition/rows_ok"].value != rows:
        raise SystemExit(f"only {md['partition/rows_ok'].value} of {rows} rows ok")
    rate, steady = steady_rate(stats["series"], "tokens")
    return {
        "rows": rows,
        "received": stats.get("received", 0),
        "rate_limited": stats.get("rate_limited", 0),
        "tokens_per_s": rate,
        "steady_seconds": steady,
        "wall_s": md["run/wall_s"].value,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def child(rows: int, tpm: int | None, dimensions: int) -> dict:
    """`one_run` in a fresh process, for its own peak RSS."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--rows",
        str(rows),
        "--dimensions",
        str(dimensions),
    ]
    cmd += ["--tpm", str(tpm or 0)]  # 0: no limit
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--tpm", type=int, default=1_000_000)
    ap.add_argument("--dimensions", type=int, default=256)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--make-table", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_table:
        make_table(args.make_table, args.rows, distinct=True)
        return
    if args.child:
        print(json.dumps(one_run(args.rows, args.tpm or None, args.dimensions)))
        return
    limited = child(args.rows, args.tpm, args.dimensions)
    large = child(args.rows, None, args.dimensions)
    small = child(max(1, args.rows // 10), None, args.dimensions)
    figures = {
        "rows": args.rows,
        "requests": limited["received"],
        "utilization": round(limited["tokens_per_s"] / (args.tpm / 60), 4),
        "rate_limited_share": round(limited["rate_limited"] / max(1, limited["received"]), 4),
        "rows_per_s_unlimited": round(args.rows / large["wall_s"], 1),
        "rss_ratio_100k_10k": round(large["peak_rss_mb"] / small["peak_rss_mb"], 3),
    }
    print(
        json.dumps(
            {"tpm": args.tpm, "dimensions": args.dimensions, "runs": [limited, large, small]}
        )
    )
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
