"""A schedule for the latest complete daily (or other time-window) partition."""

from __future__ import annotations

import dagster as dg

from ..engine.errors import BatchLLMError


def build_latest_partition_schedule(
    *,
    asset: dg.AssetsDefinition,
    name: str | None = None,
    hour_of_day: int = 1,
    minute_of_hour: int = 0,
    default_status: dg.DefaultScheduleStatus = dg.DefaultScheduleStatus.STOPPED,
) -> dg.ScheduleDefinition:
    """Each period, materialise the partition that has just closed (yesterday, for daily)."""
    if not isinstance(asset.partitions_def, dg.TimeWindowPartitionsDefinition):
        raise BatchLLMError(
            description=f"Asset {asset.key.to_user_string()} needs time-window partitions for a "
            "latest-partition schedule."
        )
    base = asset.key.path[-1]
    job = dg.define_asset_job(
        f"{base}_job", selection=[asset.key], partitions_def=asset.partitions_def
    )
    return dg.build_schedule_from_partitioned_job(
        job,
        name=name or f"{base}_latest_partition",
        hour_of_day=hour_of_day,
        minute_of_hour=minute_of_hour,
        default_status=default_status,
    )
