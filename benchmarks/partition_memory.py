"""Does a partition's memory grow with its size? Peak RSS and throughput of one partition run.

Materialises one daily partition of an N-row DuckDB table through the batch asset, against the
simulator (its own process, limits off, no latency). Peak RSS is this process's (the run's)
maximum resident set. Run it for two sizes and compare; prints one JSON line last.

    python benchmarks/partition_memory.py --rows 10000
    python benchmarks/partition_memory.py --rows 100000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time

import _common  # noqa: F401 - puts the repo on sys.path, sets TIKTOKEN_CACHE_DIR
import dagster as dg
import duckdb

from batch_llm_assets import (
    DuckDBWarehouse,
    LLMResource,
    Prompt,
    SourceTable,
    build_llm_batch_asset,
)
from batch_llm_assets.simulator import SimulatorProcess


def make_table(path: str, rows: int, *, distinct: bool = False) -> None:
    """One day of `rows` headlines. They repeat (997 companies x 13 quarters), so identical
    requests are sent once (assets/sharing.py); `distinct` makes each row's headline its own."""
    suffix = " || ' #' || i" if distinct else ""
    con = duckdb.connect(path)
    con.execute(
        "CREATE TABLE headlines AS SELECT i AS id, "
        "TIMESTAMPTZ '2026-11-01 00:00:00+00' + to_seconds(i % 86400) AS published_at, "
        f"'Company ' || (i % 997) || ' reports quarter ' || (i % 13) || ' results'{suffix} "
        "AS headline FROM range(1, ? + 1) t(i)",
        [rows],
    )
    con.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--chunk-rows", type=int, default=1000)
    ap.add_argument(
        "--distinct", action="store_true", help="a distinct headline per row: every row is sent"
    )
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "bench.duckdb")
        make_table(db, args.rows, distinct=args.distinct)
        asset = build_llm_batch_asset(
            name="bench",
            source=SourceTable(table="headlines", partition_column="published_at"),
            prompt=Prompt(template="{{ headline }}. Answer with one of: up, down, flat"),
            output="bench_out",
            params={"max_tokens": 4},
            partitions_def=dg.DailyPartitionsDefinition(start_date="2026-11-01"),
            chunk_rows=args.chunk_rows,
        )
        with SimulatorProcess(latency_ms=0, latency_per_token_ms=0, jitter=0) as sim:
            resources = {
                "llm": LLMResource(
                    base_url=sim.url,
                    model="gpt-4o-mini",
                    max_concurrency=64,
                    adaptive_concurrency=False,  # the simulator plays a hosted API: 64 in flight
                ),
                "warehouse": DuckDBWarehouse(database=db),
            }
            started = time.monotonic()
            result = dg.materialize(
                [asset], resources=resources, partition_key="2026-11-01", raise_on_error=True
            )
            wall = time.monotonic() - started
        md = result.asset_materializations_for_node("bench")[0].metadata
        ok = md["partition/rows_ok"].value
    if ok != args.rows:
        raise SystemExit(f"only {ok} of {args.rows} rows ok")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "rows": args.rows,
                "peak_rss_mb": round(peak_mb, 1),
                "rows_per_s": round(args.rows / wall, 1),
                "engine_rows_per_s": md["run/rows_per_s"].value,
                "wall_s": round(wall, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
