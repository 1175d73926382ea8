"""Embeddings through the asset against the simulator: utilisation of a TPM limit and its 429s,
requests per row with the default packing, rows/s with no limit, and peak RSS at N vs N/10 rows.

    python benchmarks/embeddings.py [--rows 100000] [--tpm 1000000] [--dimensions 256]

Each figure comes from one daily partition of a table of distinct headlines (every row is sent),
materialised by build_llm_embedding_asset with its default packing, each run in a process of its
own (peak RSS is that process's maximum resident set):
- the LLM resource is told the provider is OpenAI, the model's: vectors travel as base64 of
  float32, as the openai SDK asks for them;
- limited (DuckDB): the simulator enforces `--tpm` (a 1 s bucket), the LLM resource is told the
  same; utilization = tokens admitted per second at the simulator in the steady seconds /
  (tpm / 60); rate_limited_share = the simulator's 429s / the requests it received;
- unlimited: no limits, no latency. rows_per_s_unlimited: N rows on DuckDB / the run's wall
  time. rss_ratio_100k_10k: the peak RSS of the N-row run over the N/10-row run's with the
  warehouse in a process of its own, as BigQuery is in production (the local bqemulator): the
  asset's own memory. rss_ratio_100k_10k_duckdb: the same on an embedded DuckDB, whose memory
  is the process's too: its buffer pool (capped here at 64 MB; uncapped, up to 80 % of RAM)
  fills with the vectors written, and its request_hash index grows with the table.
Last line: {"rows", "requests", "utilization", "rate_limited_share", "rows_per_s_unlimited",
"rss_ratio_100k_10k", "rss_ratio_100k_10k_duckdb"}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import _common  # noqa: F401 - puts the repo on sys.path, sets TIKTOKEN_CACHE_DIR
import dagster as dg
from google.api_core.client_options import ClientOptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import bigquery
from partition_memory import make_table
from utilization import steady_rate

from batch_llm_assets import DuckDBWarehouse, LLMResource, SourceTable, build_llm_embedding_asset
from batch_llm_assets.resources.bigquery_warehouse import BigQueryWarehouse
from batch_llm_assets.simulator import SimulatorProcess
from batch_llm_assets.simulator.bqemulator import BigQueryEmulatorProcess

MODEL = "text-embedding-3-small"
DUCKDB_CONFIG = {"memory_limit": "64MB"}
BQ_PROJECT = "bench-project"
# partition_memory.make_table's headlines, in BigQuery SQL.
BQ_TABLE_SQL = (
    "CREATE TABLE `bench`.`headlines` AS SELECT i AS id, "
    "TIMESTAMP_ADD(TIMESTAMP '2026-11-01 00:00:00+00', INTERVAL MOD(i, 86400) SECOND) "
    "AS published_at, CONCAT('Company ', CAST(MOD(i, 997) AS STRING), ' reports quarter ', "
    "CAST(MOD(i, 13) AS STRING), ' results #', CAST(i AS STRING)) AS headline "
    "FROM UNNEST(GENERATE_ARRAY(1, @rows)) AS i"
)


def one_run(rows: int, tpm: int | None, dimensions: int, warehouse: str) -> dict:
    """One partition of `rows` distinct headlines embedded; the simulator's and the run's figures."""
    with tempfile.TemporaryDirectory() as tmp, _warehouse(warehouse, tmp, rows) as (wh, table):
        asset = build_llm_embedding_asset(
            name="bench",
            source=SourceTable(table=table, partition_column="published_at"),
            text="{{ headline }}",
            output=table.replace("headlines", "bench_embeddings"),
            model=MODEL,
            dimensions=dimensions,
            partitions_def=dg.DailyPartitionsDefinition(start_date="2026-11-01"),
        )
        latency = {"latency_ms": 20, "latency_per_token_ms": 0} if tpm else {"latency_ms": 0}
        with SimulatorProcess(tpm=tpm, jitter=0, **latency) as sim:
            llm = LLMResource(
                base_url=sim.url,
                model="gpt-4o-mini",
                tpm=tpm,
                adaptive_concurrency=False,
                provider="openai",
            )
            resources = {"llm": llm, "warehouse": wh}
            result = dg.materialize([asset], resources=resources, partition_key="2026-11-01")
            stats = sim.stats()
    md = result.asset_materializations_for_node("bench")[0].metadata
    if md["partition/rows_ok"].value != rows:
        raise SystemExit(f"only {md['partition/rows_ok'].value} of {rows} rows ok")
    rate, steady = steady_rate(stats["series"], "tokens")
    return {
        "rows": rows,
        "warehouse": warehouse,
        "received": stats.get("received", 0),
        "rate_limited": stats.get("rate_limited", 0),
        "tokens_per_s": rate,
        "steady_seconds": steady,
        "wall_s": md["run/wall_s"].value,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


@contextlib.contextmanager
def _warehouse(kind: str, tmp: str, rows: int) -> Iterator[tuple[Any, str]]:
    """The warehouse resource and its table of `rows` headlines (made in another process)."""
    if kind == "duckdb":
        db = os.path.join(tmp, "bench.duckdb")
        # Made in a process of its own: DuckDB's allocator keeps what it took to build it.
        subprocess.run(
            [sys.executable, __file__, "--make-table", db, "--rows", str(rows)], check=True
        )
        # DuckDB keeps the table it writes in its buffer pool, up to its memory_limit
        # (default: 80 % of RAM): capped, so peak RSS shows less of DuckDB's cache.
        yield DuckDBWarehouse(database=db, connection_config=DUCKDB_CONFIG), "headlines"
        return
    with BigQueryEmulatorProcess(os.path.join(tmp, "bq"), BQ_PROJECT) as emulator:
        client = bigquery.Client(
            project=BQ_PROJECT,
            credentials=AnonymousCredentials(),
            client_options=ClientOptions(api_endpoint=emulator.url),
        )
        client.query("CREATE SCHEMA `bench`").result()
        client.query(BQ_TABLE_SQL, job_config=_rows_param(rows)).result()
        client.close()
        yield BigQueryWarehouse(project=BQ_PROJECT, api_endpoint=emulator.url), "bench.headlines"


def _rows_param(rows: int) -> bigquery.QueryJobConfig:
    return bigquery.QueryJobConfig(
        query_parameters=[bigquery.ScalarQueryParameter("rows", "INT64", rows)]
    )


def child(rows: int, tpm: int | None, dimensions: int, warehouse: str = "duckdb") -> dict:
    """`one_run` in a fresh process, for its own peak RSS."""
    cmd = [sys.executable, __file__, "--child", "--rows", str(rows), "--warehouse", warehouse]
    cmd += ["--dimensions", str(dimensions), "--tpm", str(tpm or 0)]  # tpm 0: no limit
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--tpm", type=int, default=1_000_000)
    ap.add_argument("--dimensions", type=int, default=256)
    ap.add_argument("--warehouse", choices=("duckdb", "bigquery"), default="duckdb")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--make-table", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_table:
        make_table(args.make_table, args.rows, distinct=True)
        return
    if args.child:
        print(json.dumps(one_run(args.rows, args.tpm or None, args.dimensions, args.warehouse)))
        return
    small_rows = max(1, args.rows // 10)
    limited = child(args.rows, args.tpm, args.dimensions)
    large, small = (child(n, None, args.dimensions) for n in (args.rows, small_rows))
    bq_large, bq_small = (
        child(n, None, args.dimensions, "bigquery") for n in (args.rows, small_rows)
    )
    figures = {
        "rows": args.rows,
        "requests": limited["received"],
        "utilization": round(limited["tokens_per_s"] / (args.tpm / 60), 4),
        "rate_limited_share": round(limited["rate_limited"] / max(1, limited["received"]), 4),
        "rows_per_s_unlimited": round(args.rows / large["wall_s"], 1),
        "rss_ratio_100k_10k": round(bq_large["peak_rss_mb"] / bq_small["peak_rss_mb"], 3),
        "rss_ratio_100k_10k_duckdb": round(large["peak_rss_mb"] / small["peak_rss_mb"], 3),
    }
    runs = [limited, large, small, bq_large, bq_small]
    print(json.dumps({"tpm": args.tpm, "dimensions": args.dimensions, "runs": runs}))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
