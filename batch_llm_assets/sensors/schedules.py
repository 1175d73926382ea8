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
    pdef = asset.partitions_def
    job = dg.define_asset_job(f"{base}_job", selection=[asset.key], partitions_def=pdef)

    # Not build_schedule_from_partitioned_job: its tick targets the window that has just closed
    # even past the definition's end_date (a partition that does not exist). This one targets
    # the last closed partition that exists at the tick, which is inside the range by
    # construction (after the end: the last one again, whose done rows are skipped).
    @dg.schedule(
        name=name or f"{base}_latest_partition",
        cron_schedule=pdef.get_cron_schedule(
            minute_of_hour=minute_of_hour, hour_of_day=hour_of_day
        ),
        job=job,
        execution_timezone=pdef.timezone,
        default_status=default_status,
    )
    def _latest(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        keys = pdef.get_partition_keys(current_time=context.scheduled_execution_time)
        if not keys:
            return dg.SkipReason(f"No partition of {asset.key.to_user_string()} has closed yet.")
        return dg.RunRequest(partition_key=keys[-1])

    return _latest
