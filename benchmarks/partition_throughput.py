"""Does the warehouse slow a partition down? One partition through the asset vs the bare engine.

One daily partition of N rows (default 20,000) goes through the batch asset against the simulator
(its own process, limits off, no latency), with every chunk write taking `--write-latency-s`
longer (a BigQuery MERGE is a job of 1-5 s; injected by wrapping the DuckDB session). The same
requests also go through the bare engine (`LLMResource.chat_batch`, no warehouse) in the same
run, in interleaved rounds (`--rounds`, default 3; the best of each is reported, as
overhead.py does). rows_per_s is the partition run's (from opening the warehouse session to
closing it: preflight, reads, sends, writes); answer_rows_per_s stops at the last answer (the
final write, which no pipeline can start before it, left out). Prints one JSON line last.

    python benchmarks/partition_throughput.py --write-latency-s 0
    python benchmarks/partition_throughput.py --write-latency-s 2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time

import _common  # noqa: F401 - puts the repo on sys.path, sets TIKTOKEN_CACHE_DIR
import dagster as dg
import duckdb
from partition_memory import make_table
from pydantic import Field

from batch_llm_assets import (
    ChatRequest,
    DuckDBWarehouse,
    LLMResource,
    Prompt,
    SourceTable,
    build_llm_batch_asset,
)
from batch_llm_assets.simulator import SimulatorProcess
from batch_llm_assets.warehouses.duckdb_session import DuckDBSession

TEMPLATE = "{{ headline }}. Answer with one of: up, down, flat"
PARAMS = {"max_tokens": 4}


class _SlowSession(DuckDBSession):
    delay_s = 0.0

    def write_results(self, output, rows):
        LAST_ANSWER[0] = max(LAST_ANSWER[0], *(r["completed_at"].timestamp() for r in rows))
        time.sleep(self.delay_s)
        super().write_results(output, rows)


class SlowDuckDBWarehouse(DuckDBWarehouse):
    """DuckDB whose every write takes `write_latency_s` longer; records the session's span."""

    write_latency_s: float = Field(default=0.0, description="Extra seconds per chunk write.")

    @contextlib.contextmanager
    def session(self):
        with self.get_connection() as conn:
            s = _SlowSession(conn)
            s.delay_s = self.write_latency_s
            SPAN[:] = [time.time()]
            LAST_ANSWER[0] = 0.0
            try:
                yield s
            finally:
                SPAN.append(time.time())
                conn.close()


SPAN: list[float] = []  # wall clock: the session's open and close
LAST_ANSWER = [0.0]  # wall clock: the latest completed_at written


def engine_rate(llm: LLMResource, db: str) -> float:
    """The bare engine on the asset's requests (the same rendered prompts and params)."""
    con = duckdb.connect(db, read_only=True)
    rows = con.execute("SELECT id, headline FROM headlines ORDER BY id").fetchall()
    con.close()
    reqs = [
        ChatRequest(i, [{"role": "user", "content": TEMPLATE.replace("{{ headline }}", h)}])
        for i, h in rows
    ]

    async def run() -> int:
        return len([r async for r in llm.chat_batch(reqs) if r.ok])

    started = time.monotonic()
    ok = asyncio.run(run())
    wall = time.monotonic() - started
    if ok != len(reqs):
        raise SystemExit(f"engine: only {ok} of {len(reqs)} requests ok")
    return len(reqs) / wall


def partition_rate(
    llm: LLMResource, db: str, args: argparse.Namespace, round_: int
) -> tuple[float, float]:
    """One run of the partition through the asset, into its own output table: rows/s over the
    whole run, and over the answers alone (from the start to the last answer)."""
    asset = build_llm_batch_asset(
        name=f"bench{round_}",
        source=SourceTable(table="headlines", partition_column="published_at"),
        prompt=Prompt(template=TEMPLATE),
        output=f"bench_out_{round_}",
        params=PARAMS,
        partitions_def=dg.DailyPartitionsDefinition(start_date="2026-11-01"),
        chunk_rows=args.chunk_rows,
    )
    result = dg.materialize(
        [asset],
        resources={
            "llm": llm,
            "warehouse": SlowDuckDBWarehouse(database=db, write_latency_s=args.write_latency_s),
        },
        partition_key="2026-11-01",
        raise_on_error=True,
    )
    ok = result.asset_materializations_for_node(f"bench{round_}")[0].metadata["run/rows_ok"].value
    if ok != args.rows:
        raise SystemExit(f"only {ok} of {args.rows} rows ok")
    return args.rows / (SPAN[1] - SPAN[0]), args.rows / (LAST_ANSWER[0] - SPAN[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--write-latency-s", type=float, default=0.0)
    ap.add_argument("--chunk-rows", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds of engine and asset; the best of each is reported (the "
        "machine's drift and steal time only ever slow a round down)",
    )
    args = ap.parse_args()

    engine_rates: list[float] = []
    rates: list[float] = []
    answer_rates: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("BATCH_LLM_JOURNAL_DIR", os.path.join(tmp, "journal"))
        db = os.path.join(tmp, "bench.duckdb")
        make_table(db, args.rows, distinct=True)  # every row sent, as by the bare engine
        with SimulatorProcess(latency_ms=0, latency_per_token_ms=0, jitter=0) as sim:
            llm = LLMResource(
                base_url=sim.url,
                model="gpt-4o-mini",
                params=PARAMS,
                max_concurrency=args.concurrency,
                adaptive_concurrency=False,  # the simulator plays a hosted API: a fixed cap
            )
            for round_ in range(args.rounds):
                engine_rates.append(engine_rate(llm, db))
                whole, answers = partition_rate(llm, db, args, round_)
                rates.append(whole)
                answer_rates.append(answers)
    rows_per_s, engine_rows_per_s = max(rates), max(engine_rates)
    print(
        json.dumps(
            {
                "rows": args.rows,
                "rows_per_s": round(rows_per_s, 1),
                "engine_rows_per_s": round(engine_rows_per_s, 1),
                "ratio_to_engine": round(rows_per_s / engine_rows_per_s, 3),
                "write_latency_s": args.write_latency_s,
                "answer_rows_per_s": round(max(answer_rates), 1),
                "answer_ratio_to_engine": round(max(answer_rates) / engine_rows_per_s, 3),
                "rounds": args.rounds,
                "rows_per_s_rounds": [round(r, 1) for r in rates],
                "engine_rows_per_s_rounds": [round(r, 1) for r in engine_rates],
            }
        )
    )


if __name__ == "__main__":
    main()
