"""The cost estimate from the Dagster UI: a small job per batch asset, `<asset>_estimate`.

Launched from the Launchpad before a backfill (its config: one partition, a range, or nothing
for every missing partition), it sends nothing to the provider and records the estimate as an
AssetObservation of the asset: the figures appear on the asset's page beside its
materializations, and the run's log holds the table.

A job rather than definition-time metadata, because an estimate reads the warehouse (every
row of the partitions asked for), which a code location must not do each time it loads; and
rather than an asset check, because a check judges data that was written, while an estimate is
a figure about data not yet sent (a check would also run in every materialization).
"""

import dagster as dg
from pydantic import Field

from ..engine.errors import BatchLLMError
from .estimate import batch_spec, estimate_cost, select_partitions


class EstimateConfig(dg.Config):
    """Which partitions to estimate: one, a range, or (nothing set) every missing one."""

    partition: str | None = Field(
        default=None, description="One partition key. Leave all unset: every missing partition."
    )
    start: str | None = Field(default=None, description="First partition of a range (with end).")
    end: str | None = Field(default=None, description="Last partition of a range (included).")


def build_estimate_job(*, asset: dg.AssetsDefinition, name: str | None = None) -> dg.JobDefinition:
    """A job that estimates what materializing partitions of `asset` would cost (sending
    nothing) and records it as an observation of the asset."""
    spec = batch_spec(asset)
    llm_key, warehouse_key = spec.llm_resource_key, spec.warehouse_resource_key
    job_name = name or f"{asset.key.to_python_identifier()}_estimate"

    @dg.op(
        name=f"{job_name}_op",
        required_resource_keys={llm_key, warehouse_key},
        description=f"Estimate the cost of {asset.key.to_user_string()} (sends nothing).",
        # A DuckDB file takes one process at a time: the estimate queues with the asset's runs.
        pool=spec.pool_name if spec.warehouse_kind == "duckdb" else None,
    )
    def _estimate(context: dg.OpExecutionContext, config: EstimateConfig) -> None:
        given = (config.partition, config.start, config.end)
        try:
            keys = select_partitions(
                asset,
                partition=config.partition,
                start=config.start,
                end=config.end,
                missing=asset.partitions_def is not None and all(v is None for v in given),
                instance=context.instance,
            )
            est = estimate_cost(
                asset,
                llm=getattr(context.resources, llm_key),
                warehouse=getattr(context.resources, warehouse_key),
                partitions=keys,
            )
        except BatchLLMError as exc:  # a bad partition, an unreadable table: said, not traced
            raise dg.Failure(description=exc.description) from None
        context.log.info(f"{est.table()}\n{est.json_line()}")
        context.log_event(
            dg.AssetObservation(
                asset_key=asset.key,
                partition=keys[0] if len(keys) == 1 else None,
                metadata=est.metadata(),
            )
        )

    @dg.job(
        name=job_name,
        description=f"What materializing partitions of {asset.key.to_user_string()} would cost, "
        "before a backfill: rows, tokens, distinct requests, cost at live and Batch prices. "
        "Sends nothing; records an observation of the asset.",
        tags={"batch_llm/estimate": "true"},
    )
    def _job() -> None:
        _estimate()

    return _job
