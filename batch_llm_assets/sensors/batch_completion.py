"""A sensor that materialises a batch-mode partition once all its provider batches ended.

For assets built with `mode="batch"` and `BatchSettings(wait=False)`: the run submits and ends;
this sensor reads the state table, asks the provider about each open batch and requests a run of
the partition when none is still in progress. That run only collects (and resubmits what an
expired or cancelled batch did not reach). The run key names the batches, so a partition is
requested once per set of batches even if the cursor is lost.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

import dagster as dg

from ..assets.batch_mode import state_table_for
from ..engine.batch_api import TERMINAL, BatchAPIError, BatchClient
from ..engine.errors import BatchLLMError
from ..resources.llm import LLMResource
from ..warehouses.base import Warehouse

DEFAULT_TICK_BUDGET_S = 40.0  # stop asking the provider before Dagster's 60 s tick limit


def build_batch_completion_sensor(
    *,
    asset: dg.AssetsDefinition,
    name: str | None = None,
    llm_resource_key: str = "llm",
    warehouse_resource_key: str = "warehouse",
    minimum_interval_seconds: int = 300,
    tick_budget_s: float = DEFAULT_TICK_BUDGET_S,
    default_status: dg.DefaultSensorStatus = dg.DefaultSensorStatus.STOPPED,
) -> dg.SensorDefinition:
    """Watch the batches `asset` submitted; request each partition whose batches all ended."""
    output = (asset.metadata_by_key.get(asset.key) or {}).get("batch_llm/output_table")
    if not isinstance(output, str):
        raise BatchLLMError(
            description=f"Asset {asset.key.to_user_string()} was not built by "
            "build_llm_batch_asset: the batch-completion sensor needs its output table."
        )
    state_table = state_table_for(output)
    asset_name = asset.key.to_user_string()

    @dg.sensor(
        name=name or f"{asset.key.path[-1]}_batch_completion",
        asset_selection=[asset.key],
        minimum_interval_seconds=minimum_interval_seconds,
        required_resource_keys={llm_resource_key, warehouse_resource_key},
        default_status=default_status,
        description=f"Materialises partitions of {asset_name} when their Batch API batches end.",
    )
    def _sensor(context: dg.SensorEvaluationContext, **resources: object):
        llm: LLMResource = getattr(context.resources, llm_resource_key)
        warehouse: Warehouse = getattr(context.resources, warehouse_resource_key)
        try:
            with warehouse.session() as session:
                states = session.batch_states(state_table, asset_name, open_only=True)
        except BatchLLMError as exc:
            context.log.error(str(exc.description))
            return dg.SkipReason(f"Cannot read {state_table!r}: {exc.description}")
        by_partition: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for record in states:
            by_partition[record["partition_key"]].append(record)
        if not by_partition:
            return dg.SkipReason("No open batches.")
        try:
            ready, waiting = asyncio.run(_ended(llm, by_partition, tick_budget_s))
        except BatchAPIError as exc:
            return dg.SkipReason(f"Provider not reachable: {exc.description}")
        requests = [
            dg.RunRequest(
                run_key=f"{asset_name}:{pk}:" + ",".join(sorted(ids)),
                partition_key=pk,
                tags={"batch_llm/collect": "true"},
            )
            for pk, ids in sorted(ready.items())
        ]
        if not requests:
            return dg.SkipReason(f"{waiting} partition(s) still have batches in progress.")
        return dg.SensorResult(run_requests=requests)

    return _sensor


async def _ended(
    llm: LLMResource, by_partition: dict[str, list[dict[str, Any]]], budget_s: float
) -> tuple[dict[str, list[str]], int]:
    """({partition: batch or intent ids} of partitions with no batch in progress, waiting)."""
    ready: dict[str, list[str]] = {}
    waiting = 0
    stop = time.monotonic() + budget_s
    async with BatchClient(
        base_url=llm.base_url, api_key=llm.api_key, api_version=llm.api_version
    ) as client:
        for pk, records in by_partition.items():
            if time.monotonic() > stop:  # the next tick looks at the rest
                break
            ids = []
            ended = True
            for record in records:
                if record["state"] == "submitted":
                    batch = await client.retrieve(record["batch_id"])
                    ended = ended and batch["status"] in TERMINAL
                # An `uploaded` record is a run that stopped before submitting: a run recovers it.
                ids.append(record["batch_id"] or record["intent_id"])
                if not ended:
                    break
            if ended:
                ready[pk] = ids
            else:
                waiting += 1
    return ready, waiting
