"""Batch API or live requests? Cost and wall time of the demo partition (300 rows) in both modes.

The demo asset's prompt and params (batch_llm_assets/defs/headline_sentiment/defs.yaml) over one
day of the demo table, against the simulator (its own process): once live (one chat request per
row, the demo's concurrency, the simulator's default latency, no limits), once through the Batch
API (files + batches, polled). Cost comes from the price functions (assets/pricing.py) on the
tokens the simulator reported; batch mode pays BATCH_PRICE_FACTOR of the live price.

The batch wall time is SIMULATED: the simulator finishes a batch after --completion-s seconds,
standing in for a real provider's queue, which may take up to its 24 h completion window.
Prints one JSON line last.

    python benchmarks/batch_vs_live.py --completion-s 5
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

import _common  # noqa: F401 - puts the repo on sys.path, sets TIKTOKEN_CACHE_DIR
import dagster as dg
import yaml

from batch_llm_assets import DuckDBWarehouse, LLMResource, Prompt, SourceTable
from batch_llm_assets.assets import build_llm_batch_asset
from batch_llm_assets.assets.batch_mode import BatchSettings
from batch_llm_assets.assets.batch_results import BATCH_PRICE_FACTOR
from batch_llm_assets.demo_data import DEMO_START, ROWS_PER_DAY, create_demo_table
from batch_llm_assets.simulator import SimulatorProcess

DEMO_YAML = (
    Path(__file__).resolve().parents[1] / "batch_llm_assets/defs/headline_sentiment/defs.yaml"
)


def demo_asset(mode: str, output: str, batch: BatchSettings | None = None) -> dg.AssetsDefinition:
    attrs = yaml.safe_load(DEMO_YAML.read_text())["attributes"]
    src, parts = attrs["source"], attrs["partitions"]
    return build_llm_batch_asset(
        name=f"demo_{mode}",
        source=SourceTable(
            table=src["table"],
            id_column=src["id_column"],
            partition_column=src["partition_column"],
            columns=src["columns"],
        ),
        # The demo's prompt as a one-word label: batch mode does not take output_schema yet.
        prompt=Prompt(
            template=attrs["prompt"]["template"]
            + "\nAnswer with one of: positive, negative, neutral",
            system=attrs["prompt"]["system"],
        ),
        output=output,
        params=attrs["params"],
        partitions_def=dg.DailyPartitionsDefinition(
            start_date=parts["start_date"], end_date=parts["end_date"]
        ),
        mode=mode,  # type: ignore[arg-type]
        batch=batch,
    )


def run(asset: dg.AssetsDefinition, sim: SimulatorProcess, db: str) -> dict[str, float]:
    resources = {
        # Priced at gpt-4o-mini's live list price: the simulator is local, which costs 0.
        "llm": LLMResource(
            base_url=sim.url,
            api_key="sk-bench",
            model="gpt-4o-mini",
            price_input_per_1m=0.15,
            price_output_per_1m=0.6,
            adaptive_concurrency=False,  # the simulator plays OpenAI: its fixed concurrency
        ),
        "warehouse": DuckDBWarehouse(database=db),
    }
    started = time.perf_counter()
    result = dg.materialize([asset], resources=resources, partition_key=DEMO_START)
    wall = time.perf_counter() - started
    mat = result.asset_materializations_for_node(asset.key.path[-1])[-1]
    md = {k: v.value for k, v in mat.metadata.items()}
    return {
        "rows_ok": md["run/rows_ok"],
        "prompt_tokens": md["run/prompt_tokens"],
        "completion_tokens": md["run/completion_tokens"],
        "cost_usd": md["run/cost_usd"],
        "wall_s": round(wall, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--completion-s", type=float, default=5.0, help="simulated batch duration")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, SimulatorProcess(api_key="sk-bench") as sim:
        db = os.path.join(tmp, "demo.duckdb")
        create_demo_table(db, days=1)
        req = urllib.request.Request(
            sim.root + "/admin/batch_config",
            data=json.dumps({"completion_s": args.completion_s}).encode(),
            method="POST",
        )
        urllib.request.urlopen(req, timeout=10).close()
        live = run(demo_asset("live", "sentiment_live"), sim, db)
        batch = run(
            demo_asset("batch", "sentiment_batch", BatchSettings(poll_first_s=1, poll_max_s=2)),
            sim,
            db,
        )
        stats = sim.stats()
    print(
        json.dumps(
            {
                "rows": ROWS_PER_DAY,
                "model": "gpt-4o-mini",
                "live": live,
                "batch": batch,
                "batch_price_factor": BATCH_PRICE_FACTOR,
                "cost_ratio": round(batch["cost_usd"] / live["cost_usd"], 3),
                "batch_wall_is_simulated": True,
                "simulated_completion_s": args.completion_s,
                "batches_created": stats.get("batches_created", 0),
                "live_requests": stats.get("answered", 0),
            }
        )
    )


if __name__ == "__main__":
    main()
